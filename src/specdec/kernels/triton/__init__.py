"""Triton kernels for the CUDA path, each beside its torch reference (tested on CPUs under
``TRITON_INTERPRET=1``). Importing a kernel module needs triton; specdec imports them lazily."""
