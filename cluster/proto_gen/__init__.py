"""Generated from cluster/proto/pdcluster_v1.proto by ``python -m cluster.gen_proto``."""
