"""Transport implementations (see ``kv_transfer.transport``)."""
