"""The fused custom ops, one module each (imported by ``registry.load_ops``; each module's
``__all__`` lists its public entry points, re-exported as ``npu_fuse.ops``)."""
