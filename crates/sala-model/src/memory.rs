//! What a model needs in memory: weights, and per sequence the sparse layers' K/V with their
//! compressed tiers plus the lightning layers' fixed-size states (SPEC §4.4, §5.7).

use sala_checkpoint::{MixerKind, ModelConfig};

/// Bytes of one bf16 value.
const BF16: usize = 2;

/// Bytes of one sequence's cache at `context` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheBytes {
    /// Full K and V of every sparse layer.
    pub kv: usize,
    /// Level-1 and level-2 compressed keys.
    pub compressed: usize,
    /// The lightning layers' fp32 states (independent of the context).
    pub lightning_state: usize,
}

impl CacheBytes {
    pub fn total(&self) -> usize {
        self.kv + self.compressed + self.lightning_state
    }
}

pub fn cache_bytes(c: &ModelConfig, context: usize) -> CacheBytes {
    let sparse = c.layer_count(MixerKind::Sparse);
    let lightning = c.layer_count(MixerKind::Lightning);
    let s = &c.sparse;
    let windows = |w: usize, st: usize| {
        if context >= w {
            (context - w) / st + 1
        } else {
            0
        }
    };
    let n1 = windows(s.k1_window(), s.k1_stride());
    let n2 = windows(s.k2_window(), s.k2_stride());
    CacheBytes {
        kv: sparse * 2 * context * c.kv_dim() * BF16,
        compressed: sparse * (n1 + n2) * c.kv_dim() * BF16,
        lightning_state: lightning * c.num_attention_heads * c.head_dim * c.head_dim * 4,
    }
}

/// Bytes of the weights in bf16.
pub fn weight_bytes(c: &ModelConfig) -> usize {
    sala_checkpoint::expected_parameter_count(c) as usize * BF16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn released() -> ModelConfig {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/data/released_config.json"
        );
        ModelConfig::from_file(std::path::Path::new(path)).unwrap()
    }

    #[test]
    fn released_shape_matches_spec_figures() {
        let c = released();
        assert_eq!(weight_bytes(&c), 2 * 9_477_203_968); // SPEC §1
        let m = cache_bytes(&c, 1 << 20);
        assert_eq!(m.kv, 8 << 30); // 8 KiB per token (SPEC §5.7)
        assert_eq!(m.lightning_state, 48 << 20); // SPEC §4.4
        let ratio = m.compressed as f64 / (m.kv as f64 / 2.0);
        assert!((ratio - (1.0 / 16.0 + 1.0 / 64.0)).abs() < 1e-3, "{ratio}");
    }
}
