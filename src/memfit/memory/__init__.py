"""Memory: counting live tensor bytes (real or fake), the device catalogue, the CUDA allocator model."""
