"""Python code generated from proto/ (do not edit; regenerate: python -m router.grpc_gen.generate)."""
