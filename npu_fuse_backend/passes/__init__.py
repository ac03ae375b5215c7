"""Fusion passes, one module per subgraph family (imported by ``fusion.registered_fusions``)."""
