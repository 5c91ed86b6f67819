//! Loading a model's weights: from a checkpoint ([`WeightSource`]), quantized on the way
//! where the config says (FP8), or made random by the backend (benchmarks).

use crate::backend::{
    quantize_fp8, BResult, Backend, BackendError, Fp8Matrix, HostTensor, QuantMatrix,
};
use sala_checkpoint::{init_scale, tensor_name, ModelConfig, Place, Role, TensorSpec};
use std::collections::{HashMap, HashSet};

/// Where weights come from: the tensor of a given name, already checked by the loader.
pub trait WeightSource {
    fn tensor(&self, name: &str) -> Result<HostTensor<'_>, String>;
    /// Calls `f` with tensor `name`: by default the one [`WeightSource::tensor`] lends; a
    /// source that makes a tensor's values for the call (a quantized weight, dequantized)
    /// says so here, and they are gone once `f` returns.
    fn with_tensor(
        &self,
        name: &str,
        f: &mut dyn FnMut(HostTensor<'_>) -> BResult<()>,
    ) -> BResult<()> {
        let t = self
            .tensor(name)
            .map_err(|e| BackendError(format!("weight {name}: {e}")))?;
        f(t)
    }
    /// Calls `f` with weight `name` in 4 bits and returns true where the source stores it so;
    /// else false (the weight is read with [`WeightSource::with_tensor`]).
    fn with_quantized(
        &self,
        _name: &str,
        _f: &mut dyn FnMut(QuantMatrix<'_>) -> BResult<()>,
    ) -> BResult<bool> {
        Ok(false)
    }
    /// Calls `f` with weight `name` in FP8 and returns true where the source stores it so
    /// (an FP8 checkpoint); else false (an FP8 run quantizes the bf16 weight as it loads).
    fn with_fp8(
        &self,
        _name: &str,
        _f: &mut dyn FnMut(Fp8Matrix<'_>) -> BResult<()>,
    ) -> BResult<bool> {
        Ok(false)
    }
}

/// Where [`Loader`] takes weights from.
pub(crate) enum Source<'a> {
    Weights(&'a dyn WeightSource),
    /// Seeded random values made by the backend, with the checkpoint writer's init scales.
    Random {
        seed: u64,
        specs: HashMap<String, TensorSpec>,
        config: &'a ModelConfig,
    },
}

/// Uploads (or generates) weights one by one, reporting progress.
pub(crate) struct Loader<'a, B: Backend> {
    pub(crate) be: &'a B,
    pub(crate) src: Source<'a>,
    /// The weights that run in FP8 (`ModelConfig::fp8_linear`).
    pub(crate) fp8: HashSet<String>,
    pub(crate) done: usize,
    pub(crate) total: usize,
    pub(crate) progress: &'a mut dyn FnMut(usize, usize),
}

/// Shape, seed and scale of one random tensor.
struct RandomSpec {
    shape: Vec<usize>,
    seed: u64,
    mean: f32,
    std: f32,
}

/// FNV-1a of a tensor name, mixed with the seed: each tensor's random values depend only on
/// (seed, name).
fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h = 0xcbf29ce484222325u64;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    h ^ seed.wrapping_mul(0x9E3779B97F4A7C15)
}

impl<B: Backend> Loader<'_, B> {
    fn step(&mut self) {
        self.done += 1;
        (self.progress)(self.done, self.total);
    }
    /// Uploads weight `name` from the checkpoint with `upload`.
    fn fetch<T>(&self, name: &str, upload: impl Fn(HostTensor<'_>) -> BResult<T>) -> BResult<T> {
        let Source::Weights(w) = &self.src else {
            return Err(BackendError(format!("weight {name}: no checkpoint")));
        };
        let mut out = None;
        w.with_tensor(name, &mut |t| {
            out = Some(upload(t)?);
            Ok(())
        })?;
        out.ok_or_else(|| BackendError(format!("weight {name}: the source gave nothing")))
    }
    /// How to make a random tensor, or `None` when weights come from a checkpoint.
    fn random_spec(&self, name: &str) -> BResult<Option<RandomSpec>> {
        match &self.src {
            Source::Weights(_) => Ok(None),
            Source::Random {
                seed,
                specs,
                config,
            } => {
                let spec = specs.get(name).ok_or_else(|| {
                    BackendError(format!("weight {name}: not in the config's tensor list"))
                })?;
                let (mean, std) = init_scale(config, spec);
                Ok(Some(RandomSpec {
                    shape: spec.shape.clone(),
                    seed: tensor_seed(*seed, name),
                    mean: mean as f32,
                    std: std as f32,
                }))
            }
        }
    }
    pub(crate) fn mat(&mut self, role: Role, place: Place) -> BResult<B::Matrix> {
        let name = &tensor_name(role, place);
        self.step();
        let be = self.be;
        if self.fp8.contains(name) {
            if let Some(r) = self.random_spec(name)? {
                return be.random_fp8(name, r.shape[0], r.shape[1], r.seed, r.std);
            }
            if let Source::Weights(w) = &self.src {
                let mut out = None;
                let stored = w.with_fp8(name, &mut |m| {
                    out = Some(be.upload_fp8(name, m)?);
                    Ok(())
                })?;
                if stored {
                    return out
                        .ok_or_else(|| BackendError(format!("weight {name}: nothing given")));
                }
            }
            return self.fetch(name, |t| {
                let [rows, cols] = t.shape[..] else {
                    return Err(BackendError(format!(
                        "weight {name}: expected 2 dimensions, got shape {:?}",
                        t.shape
                    )));
                };
                let (codes, scales) = quantize_fp8(&t.to_f32(), rows, cols);
                let m = Fp8Matrix {
                    rows,
                    cols,
                    codes: &codes,
                    scales: &scales,
                };
                be.upload_fp8(name, m)
            });
        }
        if let Some(r) = self.random_spec(name)? {
            // A quantized config's linears come as random 4-bit matrices.
            if let Source::Random { config, .. } = &self.src {
                let linear = matches!(place, Place::Layer(..));
                if let Some(q) = config
                    .quantization
                    .as_ref()
                    .filter(|q| linear && q.quantizes(name))
                {
                    let group = q.group_size.unwrap_or(r.shape[1]);
                    return be.random_quantized(name, r.shape[0], r.shape[1], group, r.seed, r.std);
                }
            }
            return be.random_matrix(name, r.shape[0], r.shape[1], r.seed, r.mean, r.std);
        }
        if let Source::Weights(w) = &self.src {
            let mut out = None;
            let packed = w.with_quantized(name, &mut |q| {
                out = Some(be.upload_quantized(name, q)?);
                Ok(())
            })?;
            if packed {
                return out.ok_or_else(|| BackendError(format!("weight {name}: nothing given")));
            }
        }
        self.fetch(name, |t| be.upload_matrix(name, t))
    }
    pub(crate) fn vec(&mut self, role: Role, place: Place) -> BResult<B::Vector> {
        let name = &tensor_name(role, place);
        self.step();
        let be = self.be;
        match self.random_spec(name)? {
            Some(r) => be.random_vector(name, r.shape[0], r.seed, r.mean, r.std),
            None => self.fetch(name, |t| be.upload_vector(name, t)),
        }
    }
    pub(crate) fn vec_if(
        &mut self,
        present: bool,
        role: Role,
        place: Place,
    ) -> BResult<Option<B::Vector>> {
        present.then(|| self.vec(role, place)).transpose()
    }
}
