//! Rounding and small math shared by every backend and the oracle.

/// Rounds to the nearest bf16 value (ties to even), kept in an f32: the reference computes in
/// bf16 tensors, so the CPU paths round where it stores one.
#[inline]
pub fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Rounds every element of `xs` to bf16 in place.
pub fn bf16_round_slice(xs: &mut [f32]) {
    for x in xs {
        *x = bf16_round(*x);
    }
}

/// RoPE inverse frequencies `1 / theta^(2i/d)`, in f32 as the reference computes them.
pub fn rope_inv_freq(head_dim: usize, theta: f64) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
        .collect()
}

/// Element-wise closeness `|a-b| <= atol + rtol*|b|`; returns the worst offending index.
pub fn first_mismatch(a: &[f32], b: &[f32], atol: f32, rtol: f32) -> Option<(usize, f32, f32)> {
    if a.len() != b.len() {
        return Some((usize::MAX, a.len() as f32, b.len() as f32));
    }
    a.iter()
        .zip(b)
        .enumerate()
        .find(|(_, (&x, &y))| {
            let diff = (x - y).abs();
            diff.is_nan() || diff > atol + rtol * y.abs()
        })
        .map(|(i, (&x, &y))| (i, x, y))
}

/// Relative L2 error `|a-b| / |b|`.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| ((x - y) as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// A small seeded generator for tests (the project's xoshiro256**).
#[derive(Clone)]
pub struct TestRng(sala_checkpoint::rng::Rng);

impl TestRng {
    pub fn new(seed: u64) -> Self {
        Self(sala_checkpoint::rng::Rng::seed_from_u64(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi), rounded to bf16.
    pub fn bf16_uniform(&mut self, lo: f32, hi: f32) -> f32 {
        bf16_round(lo + (hi - lo) * self.uniform() as f32)
    }

    /// A vector of bf16-representable uniform values.
    pub fn bf16_vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.bf16_uniform(lo, hi)).collect()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize % n.max(1)
    }
}

fn splitmix64(z: u64) -> u64 {
    let mut state = z;
    sala_checkpoint::rng::splitmix64(&mut state)
}

/// Element `i` of the seeded normal sequence `mean + std·z` rounded to bf16, with `|z|` kept
/// in [0.001, 6] so no value is zero. The CUDA kernel `fill_random` computes the same
/// formula on the device.
pub fn random_normal(i: u64, seed: u64, mean: f32, std: f32) -> f32 {
    let r = splitmix64(seed ^ splitmix64(i));
    let u1 = ((r >> 40) as f32 + 1.0) / 16777217.0;
    let u2 = ((r & 0xffffff) as f32 + 0.5) / 16777216.0;
    let z = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::PI * 2.0 * u2).cos();
    let a = z.abs().clamp(0.001, 6.0);
    bf16_round(mean + std * a.copysign(z))
}
