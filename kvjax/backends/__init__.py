"""Native (non-Pallas) backends: the C++ CPU kernels, their build and their options."""
