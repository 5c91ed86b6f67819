//! How the CUDA backend runs: which kernel variants, where caches live, which card's limits
//! to plan for. The binary fills [`CudaOptions`] from its flags and the environment
//! ([`CudaOptions::from_env`]); tests build one per variant they check.

use crate::device::{card_named, Card};

/// Lightning prefill kernels, fastest first: each shape takes the first at or after the
/// chosen one that handles it (`Chunked` handles every shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum LightningPrefill {
    /// Ranges of chunks in parallel, each walked in order with the state on chip: the
    /// ranges' sums, their scan, then every output (`lightning_ranges`).
    #[default]
    Ranges,
    /// Three tensor-core kernels: chunk states, their scan, outputs (`lightning_chunk_*`).
    Split,
    /// fp32 chunked walk on CUDA cores (`lightning_chunked`).
    Chunked,
}

/// Block scores of the prefill selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SelectScores {
    /// Keys as MMA rows where a block holds 4 level-1 windows (`select_scores_t`, or
    /// `select_scores_wg` on Hopper), else heads as MMA rows.
    #[default]
    KeysAsRows,
    /// Heads as MMA rows for every shape (`select_scores_mma`).
    HeadsAsRows,
}

/// Decode-sized products (1..=64 rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeGemv {
    /// Tensor-core GEMVs reading the weights once per 16 rows (`gemv_mma*`).
    #[default]
    TensorCore,
    /// CUDA-core GEMVs, a launch per row; a row a warp for up to 12 288 outputs.
    CudaCore,
    /// CUDA-core GEMVs, four output rows a warp everywhere (`gemv`).
    CudaCoreWide,
}

/// Attention of the sparse layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Attention {
    /// A warp per (query, group) and 64-key block walk (`attention_gather`,
    /// `attention_decode`).
    #[default]
    WarpWalk,
    /// Staged tiles of 64 queries (`attention_prefill`, `attention`, `attention_split`).
    Staged,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CudaOptions {
    /// Plan for this card's limits instead of the device's own (on a device at least as
    /// large): its shared memory, threads and SMs, its memory as the cap, no Hopper kernels
    /// unless it has them.
    pub device_profile: Option<&'static Card>,
    pub lightning_prefill: LightningPrefill,
    pub select_scores: SelectScores,
    /// Hopper `wgmma` kernels where the device has them (else their `mma.sync` twins).
    pub wgmma: bool,
    /// Block selection with the bit-exact CUDA-core kernels (as the CPU), prefill and decode.
    pub exact_select: bool,
    pub decode_gemv: DecodeGemv,
    pub attention: Attention,
    /// Keys of K and V a stage of `attention_gather` holds: 16 (twice the warps of 32 in the
    /// same shared memory: 6-8% faster at 128K on the H100), or 32 for comparisons
    /// (`SALA_GATHER_KEYS=16|32`).
    pub gather_keys: usize,
    /// A batched decode step's sparse layers in one launch per kernel for all rows (else row
    /// by row).
    pub batched_sparse_rows: bool,
    /// The top-k's candidate keys in global memory even where shared memory holds them (the
    /// plan of small-memory cards past ~3M tokens).
    pub topk_keys_in_global: bool,
    /// Most bytes of block scores one prefill selection launch writes
    /// ([`crate::plan::SELECT_SCORES_BYTES`]; tests lower it to split a chunk's selection into
    /// several launches).
    pub select_scores_bytes: usize,
    /// Most candidate blocks a prefill top-k takes with `sd_topk_scores` (at most
    /// [`crate::plan::SD_TOPK_MAX_CANDIDATES`], its 16-bit counts); past it,
    /// `select_topk_scores` (as past ~4M tokens; tests lower it to run that kernel).
    pub topk_scores_max_candidates: usize,
    /// Per-sequence caches and states in the page pool (else one allocation each).
    pub kv_pool: bool,
    /// Allocation granules per pool page.
    pub kv_pool_granules: usize,
    /// Per-kernel device time (CUDA events around every launch).
    pub profile_kernels: bool,
    /// Each step's device span, from the first work queued to the last, graphs as they run
    /// (two CUDA events a step; `SALA_PROFILE=steps`): against the host's time a step, what
    /// the device idles between steps.
    pub profile_steps: bool,
    /// Programmatic dependent launch where the card has it (compute capability 9.0 on): each
    /// kernel is scheduled while the previous one ends, and waits for its results.
    pub pdl: bool,
    /// Decode steps (up to 64 rows) that repeat are captured into CUDA graphs and replayed.
    pub cuda_graphs: bool,
    /// Greedy decode steps run ahead: the next step is queued, its tokens the picks this one
    /// leaves on the device, before those picks reach the host (`SALA_RUN_AHEAD=0` turns it
    /// off).
    pub run_ahead: bool,
    /// FP8 GEMMs scaled by cuBLASLt's vector scales where it has them (else a pass after).
    pub fp8_vector_scales: bool,
    /// Tokens a range of the lightning prefill aims for (`SALA_LIGHTNING_RANGE_TOKENS`): more,
    /// shorter ranges walk in parallel, for more range sums to add up.
    pub lightning_range_tokens: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            device_profile: None,
            lightning_prefill: LightningPrefill::default(),
            select_scores: SelectScores::default(),
            wgmma: true,
            exact_select: false,
            decode_gemv: DecodeGemv::default(),
            attention: Attention::default(),
            gather_keys: 16,
            batched_sparse_rows: true,
            topk_keys_in_global: false,
            select_scores_bytes: crate::plan::SELECT_SCORES_BYTES,
            topk_scores_max_candidates: crate::plan::SD_TOPK_MAX_CANDIDATES,
            kv_pool: true,
            kv_pool_granules: 1,
            profile_kernels: false,
            profile_steps: false,
            pdl: true,
            cuda_graphs: true,
            run_ahead: true,
            fp8_vector_scales: true,
            lightning_range_tokens: crate::plan::LIGHTNING_RANGE_TOKENS,
        }
    }
}

/// Every name `SALA_FALLBACK` takes, and what it selects.
pub const FALLBACK_NAMES: [&str; 9] = [
    "attention",
    "lightning",
    "lightning-split",
    "select",
    "gemv",
    "gemv-mma",
    "sparse-rows",
    "wgmma",
    "fp8-scales",
];

impl CudaOptions {
    /// The defaults changed by the environment: `SALA_FALLBACK` (a comma list of
    /// [`FALLBACK_NAMES`]: the slower variants, for comparisons), `SALA_EXACT_SELECT=1`,
    /// `SALA_KV_POOL=0|1`, `SALA_KV_POOL_GRANULES=N`, `SALA_PROFILE=1|steps`, `SALA_RUN_AHEAD=0|1`,
    /// `SALA_LIGHTNING_RANGE_TOKENS=N`, `SALA_GATHER_KEYS=16|32`, `SALA_DEVICE_PROFILE=card`. A
    /// value it cannot use is an error naming the variable.
    pub fn from_env() -> Result<Self, String> {
        let var = |name: &str| std::env::var(name).ok();
        Self::from_vars(&var)
    }

    /// [`CudaOptions::from_env`] over any source of variables.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Self, String> {
        let mut o = Self::default();
        o.apply_fallbacks(&var("SALA_FALLBACK").unwrap_or_default())?;
        let flag = |name: &str| -> Result<Option<bool>, String> {
            match var(name).as_deref() {
                None => Ok(None),
                Some("0") => Ok(Some(false)),
                Some("1") => Ok(Some(true)),
                Some(v) => Err(format!("{name}={v}: expected 0 or 1")),
            }
        };
        if let Some(on) = flag("SALA_EXACT_SELECT")? {
            o.exact_select = on;
        }
        if let Some(on) = flag("SALA_KV_POOL")? {
            o.kv_pool = on;
        }
        if var("SALA_PROFILE").as_deref() == Some("steps") {
            o.profile_steps = true;
        } else if let Some(on) = flag("SALA_PROFILE")? {
            o.profile_kernels = on;
        }
        if let Some(on) = flag("SALA_PDL")? {
            o.pdl = on;
        }
        if let Some(on) = flag("SALA_CUDA_GRAPHS")? {
            o.cuda_graphs = on;
        }
        if let Some(on) = flag("SALA_RUN_AHEAD")? {
            o.run_ahead = on;
        }
        if let Some(v) = var("SALA_KV_POOL_GRANULES") {
            o.kv_pool_granules = v
                .parse::<usize>()
                .ok()
                .filter(|&g| g >= 1)
                .ok_or(format!("SALA_KV_POOL_GRANULES={v}: expected a count ≥ 1"))?;
        }
        if let Some(v) = var("SALA_LIGHTNING_RANGE_TOKENS") {
            o.lightning_range_tokens = v.parse::<usize>().ok().filter(|&t| t >= 64).ok_or(
                format!("SALA_LIGHTNING_RANGE_TOKENS={v}: expected a token count ≥ 64"),
            )?;
        }
        if let Some(v) = var("SALA_GATHER_KEYS") {
            o.gather_keys = match v.as_str() {
                "16" => 16,
                "32" => 32,
                _ => return Err(format!("SALA_GATHER_KEYS={v}: expected 16 or 32")),
            };
        }
        if let Some(v) = var("SALA_DEVICE_PROFILE").filter(|v| !v.is_empty()) {
            o.device_profile =
                Some(card_named(&v).map_err(|e| format!("SALA_DEVICE_PROFILE: {e}"))?);
        }
        Ok(o)
    }

    /// Applies a `SALA_FALLBACK` list (empty entries ignored); an unknown name is an error
    /// naming the known ones, so a typo does not silently measure the default kernels.
    pub fn apply_fallbacks(&mut self, list: &str) -> Result<(), String> {
        let names: Vec<&str> = list
            .split(',')
            .map(str::trim)
            .filter(|x| !x.is_empty())
            .collect();
        if let Some(bad) = names.iter().find(|x| !FALLBACK_NAMES.contains(x)) {
            return Err(format!(
                "SALA_FALLBACK: unknown kernel name {bad:?} (known: {})",
                FALLBACK_NAMES.join(", ")
            ));
        }
        let has = |name: &str| names.contains(&name);
        let slowest = [
            ("lightning", LightningPrefill::Chunked),
            ("lightning-split", LightningPrefill::Split),
        ]
        .into_iter()
        .find(|(n, _)| has(n));
        if let Some((_, l)) = slowest {
            self.lightning_prefill = self.lightning_prefill.max(l);
        }
        if has("attention") {
            self.attention = Attention::Staged;
        }
        if has("select") {
            self.select_scores = SelectScores::HeadsAsRows;
        }
        if has("wgmma") {
            self.wgmma = false;
        }
        if has("sparse-rows") {
            self.batched_sparse_rows = false;
        }
        if has("fp8-scales") {
            self.fp8_vector_scales = false;
        }
        self.decode_gemv = match (has("gemv-mma"), has("gemv")) {
            (false, _) => self.decode_gemv,
            (true, false) => DecodeGemv::CudaCore,
            (true, true) => DecodeGemv::CudaCoreWide,
        };
        Ok(())
    }

    /// Sets the device profile by card name (`--device-profile`).
    pub fn set_device_profile(&mut self, name: &str) -> Result<(), String> {
        self.device_profile = Some(card_named(name)?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> CudaOptions {
        let owned: Vec<(String, String)> = pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        CudaOptions::from_vars(&|n| owned.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()))
            .unwrap()
    }

    #[test]
    fn fallback_names_parse_and_typos_are_errors() {
        let o = vars(&[("SALA_FALLBACK", " lightning-split, wgmma,,")]);
        assert_eq!(o.lightning_prefill, LightningPrefill::Split);
        assert!(!o.wgmma && o.decode_gemv == DecodeGemv::TensorCore);
        // The slowest lightning variant named wins.
        let o = vars(&[("SALA_FALLBACK", "lightning-split,lightning")]);
        assert_eq!(o.lightning_prefill, LightningPrefill::Chunked);
        let o = vars(&[(
            "SALA_FALLBACK",
            "gemv-mma,gemv,sparse-rows,attention,select",
        )]);
        assert_eq!(o.decode_gemv, DecodeGemv::CudaCoreWide);
        assert!(!o.batched_sparse_rows);
        assert_eq!(o.attention, Attention::Staged);
        assert_eq!(o.select_scores, SelectScores::HeadsAsRows);
        assert_eq!(vars(&[]), CudaOptions::default());
        for name in FALLBACK_NAMES {
            assert!(
                CudaOptions::default().apply_fallbacks(name).is_ok(),
                "{name}"
            );
        }
        let e = CudaOptions::default()
            .apply_fallbacks("lightning,wgma")
            .unwrap_err();
        assert!(e.contains("\"wgma\"") && e.contains("wgmma"), "{e}");
    }

    #[test]
    fn switches_take_0_or_1_and_profiles_by_name() {
        let o = vars(&[
            ("SALA_KV_POOL", "0"),
            ("SALA_EXACT_SELECT", "1"),
            ("SALA_DEVICE_PROFILE", "rtx5090"),
            ("SALA_KV_POOL_GRANULES", "4"),
        ]);
        assert!(!o.kv_pool && o.exact_select && o.kv_pool_granules == 4);
        assert_eq!(o.device_profile.unwrap().key, "rtx5090");
        // SALA_PROFILE: 1 times every kernel, `steps` each step's span only.
        let o = vars(&[("SALA_PROFILE", "steps")]);
        assert!(o.profile_steps && !o.profile_kernels);
        let o = vars(&[("SALA_PROFILE", "1")]);
        assert!(o.profile_kernels && !o.profile_steps);
        let bad = |k: &str, v: &str| {
            let (k, v) = (k.to_string(), v.to_string());
            CudaOptions::from_vars(&move |n| (n == k).then(|| v.clone())).unwrap_err()
        };
        assert!(bad("SALA_KV_POOL", "yes").contains("SALA_KV_POOL=yes"));
        assert!(bad("SALA_PROFILE", "kernels").contains("SALA_PROFILE=kernels"));
        assert!(bad("SALA_KV_POOL_GRANULES", "0").contains("SALA_KV_POOL_GRANULES"));
        assert!(bad("SALA_DEVICE_PROFILE", "gtx1080").contains("rtx4090"));
        assert!(bad("SALA_GATHER_KEYS", "64").contains("SALA_GATHER_KEYS=64"));
        assert_eq!(vars(&[("SALA_GATHER_KEYS", "32")]).gather_keys, 32);
    }
}
