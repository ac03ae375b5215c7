"""GE graph_convert functions, one module per fused op, registered with torchair.

Imported only where torchair is importable (``lowering.npu.load_converters``).
"""
