//! Devices the model runs on. The CPU device runs everywhere; the CUDA device joins it later.

pub mod cpu;
pub mod warm;
