"""The CuTe DSL kernels (cache writer, attention generations, split-KV combine) and their one host launcher."""
