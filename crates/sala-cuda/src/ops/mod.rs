//! The backend's ops by family, each beside the kernels it launches.

pub(crate) mod attention;
pub(crate) mod elementwise;
pub(crate) mod gemv;
pub(crate) mod lightning;
pub(crate) mod logits;
pub(crate) mod select;
