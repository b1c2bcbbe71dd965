"""What every service shares: the types that cross the wire, the one proto converter,
the scheduling limits, max_model_len, gRPC settings and model files. Imports only itself."""
