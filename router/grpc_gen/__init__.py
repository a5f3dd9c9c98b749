"""Python code generated from proto/ (do not edit; regenerate: python -m pdserve.router.grpc_gen.generate)."""
