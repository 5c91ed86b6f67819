//! Loading a model onto a backend and generating text: sampling, stop strings, the loop.

pub mod batch;
pub mod generate;
pub mod sampling;
pub mod stop;
