"""The kernels' planning part, pure Python: record plans, the kernel/tile selection, the launch schedule, bit models."""
