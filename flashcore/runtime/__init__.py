"""Run prebuilt kernels: device archs, cuda-python module loading, launches on torch's stream."""
