"""The fused custom ops, one module each (imported by ``lowering.registry.load_ops``)."""
