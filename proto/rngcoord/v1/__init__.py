"""Generated gRPC stubs for the rngcoord.v1 contract. Regenerate with scripts/gen_proto.py."""
