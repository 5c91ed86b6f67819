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

pub use sala_checkpoint::fp8::{e4m3_code, e4m3_value, fp8_quantize_row, fp8_row_scale, E4M3_MAX};

/// Rounds K or V rows (`head_dim` values a KV head, heads after each other) to what an FP8
/// cache holds: each row's codes at its own scale, read back as code × scale.
pub fn fp8_round_kv(values: &mut [f32], head_dim: usize) {
    let mut codes = vec![0u8; head_dim];
    for row in values.chunks_mut(head_dim) {
        let scale = fp8_quantize_row(row, &mut codes);
        for (x, &c) in row.iter_mut().zip(&codes) {
            *x = e4m3_value(c) * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_e4m3_code_reads_back_to_itself() {
        for c in 0..=255u8 {
            if c & 0x7f == 0x7f {
                assert!(e4m3_value(c).is_nan());
                continue;
            }
            let v = e4m3_value(c);
            // Zero has two codes; the positive one comes back for +0.
            let want = if c == 0x80 { 0x80 } else { c };
            assert_eq!(e4m3_code(v), want, "code {c:#04x} value {v}");
        }
        assert_eq!(e4m3_value(0x7e), E4M3_MAX);
        assert_eq!(e4m3_value(0x01), 1.0 / 512.0);
        assert_eq!(e4m3_value(0x08), 1.0 / 64.0);
    }

    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        // Between 1 (0x38) and 1.125 (0x39): the midpoint goes to the even code.
        assert_eq!(e4m3_code(1.0625), 0x38);
        assert_eq!(e4m3_code(1.0626), 0x39);
        // Between 1.125 and 1.25 (0x3a): the midpoint goes up to the even code.
        assert_eq!(e4m3_code(1.1875), 0x3a);
        // Subnormal midpoint 1.5 * 2^-9 goes to 2 * 2^-9.
        assert_eq!(e4m3_code(1.5 / 512.0), 0x02);
        assert_eq!(e4m3_code(0.5 / 512.0), 0x00);
        assert_eq!(e4m3_code(-3.0), 0x80 | e4m3_code(3.0));
        for big in [448.0, 463.9, 464.0, 1e9, f32::INFINITY] {
            assert_eq!(e4m3_code(big), 0x7e, "{big}");
        }
        assert_eq!(e4m3_code(f32::NAN), 0x7f);
        // Every value between two codes rounds to the nearer one.
        let mut rng = TestRng::new(3);
        for _ in 0..20000 {
            let x = (rng.uniform() as f32 * 2.0 - 1.0) * 460.0 * (rng.uniform() as f32).powi(8);
            let got = e4m3_value(e4m3_code(x));
            let nearest = (0..=0x7eu8)
                .flat_map(|c| [c, c | 0x80])
                .map(e4m3_value)
                .fold(f32::INFINITY, |b, v| {
                    if (v - x).abs() < (b - x).abs() {
                        v
                    } else {
                        b
                    }
                });
            assert_eq!(
                (got - x).abs(),
                (nearest - x).abs(),
                "{x}: {got} vs {nearest}"
            );
        }
    }

    #[test]
    fn fp8_kv_rows_keep_a_sixteenth_of_each_rows_largest_value() {
        let mut rng = TestRng::new(9);
        let d = 64;
        // Rows of very different magnitudes, one of zeros.
        let mut x: Vec<f32> = (0..4 * d)
            .map(|i| {
                let row = i / d;
                if row == 2 {
                    0.0
                } else {
                    bf16_round((rng.uniform() as f32 - 0.5) * 10f32.powi(row as i32 * 3 - 4))
                }
            })
            .collect();
        let orig = x.clone();
        fp8_round_kv(&mut x, d);
        for (row, (a, b)) in orig.chunks(d).zip(x.chunks(d)).enumerate() {
            let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (u, v) in a.iter().zip(b) {
                assert!(
                    (u - v).abs() <= amax / 16.0 * 1.0001,
                    "row {row}: {u} -> {v}"
                );
            }
            let big = a.iter().position(|v| v.abs() == amax).unwrap();
            assert!(
                (a[big] - b[big]).abs() <= amax * 1e-6,
                "row {row}'s largest value moved"
            );
        }
        assert!(x[2 * d..3 * d].iter().all(|&v| v == 0.0));
    }
}
