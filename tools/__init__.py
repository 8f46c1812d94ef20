"""Developer tools run from a checkout (`python -m tools.<name>`): the CPU compile check of every kernel variant, the
hardware measurements the format specs quote (`tools.measure`), the device-run entry point (`tools/device/`) and
the embedded default model's training (`tools.train`). Not part of the installed package.
"""
