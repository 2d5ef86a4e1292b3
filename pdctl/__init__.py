"""Operations: ``pdctl`` (the admin CLI), the local launcher, topology files, process supervision,
the embedded redis-server, and the tiny test model it writes (``pdctl make-model``)."""
