//! What a GPU allows, in one value that every launch plan is computed from ([`DeviceLimits`]):
//! read from the driver, or taken from the table of cards ([`CARDS`]) to run as another card
//! would (a device profile). Facts per compute capability are the CUDA C++ Programming Guide's
//! ("Technical Specifications per Compute Capability"); per card, the vendors' datasheets and
//! what the driver reports for memory (../shared/GPUS.md).

use cudarc::driver::sys::CUdevice_attribute as A;
use cudarc::driver::CudaContext;
use std::sync::Arc;

/// The oldest compute capability the kernels run on (bf16 `mma.sync`, `cp.async`).
pub const MIN_CAPABILITY: (u32, u32) = (8, 0);

/// The compute capabilities `sala` is built and checked for.
pub const SUPPORTED: &[(u32, u32)] = &[(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)];

/// Limits per compute capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArchLimits {
    pub smem_per_sm: usize,
    /// Most shared memory one block may opt into (static + dynamic).
    pub smem_per_block_optin: usize,
    pub threads_per_sm: u32,
    pub max_blocks_per_sm: u32,
    pub regs_per_sm: u32,
    /// Hopper's `wgmma` and TMA (`sm_90a`).
    pub hopper_instructions: bool,
}

/// The guide's table for the supported capabilities; `None` for others.
pub fn arch_limits(cc: (u32, u32)) -> Option<ArchLimits> {
    let kib = |k: usize| k << 10;
    let (smem_sm, optin, threads, blocks) = match cc {
        (8, 0) => (164, 163, 2048, 32),
        (8, 6) => (100, 99, 1536, 16),
        (8, 9) => (100, 99, 1536, 24),
        (9, 0) => (228, 227, 2048, 32),
        (10, 0) => (228, 227, 2048, 32),
        (12, 0) => (128, 99, 1536, 32),
        _ => return None,
    };
    Some(ArchLimits {
        smem_per_sm: kib(smem_sm),
        smem_per_block_optin: kib(optin),
        threads_per_sm: threads,
        max_blocks_per_sm: blocks,
        regs_per_sm: 64 << 10,
        hopper_instructions: cc == (9, 0),
    })
}

/// A card `sala` must run on: the CI table and the device profiles.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Card {
    /// The profile's name (`--device-profile rtx5090`).
    pub key: &'static str,
    pub name: &'static str,
    pub cc: (u32, u32),
    pub sms: u32,
    /// Memory as the driver reports it (MiB).
    pub memory_mib: usize,
    pub l2_mib: usize,
    /// Datasheet memory bandwidth, GB/s.
    pub bandwidth_gbs: f64,
    /// Datasheet dense bf16 tensor throughput, TFLOP/s.
    pub bf16_tflops: f64,
}

/// The cards of ../shared/GPUS.md.
pub const CARDS: &[Card] = &[
    card(
        "a100",
        "NVIDIA A100 80GB SXM",
        (8, 0),
        108,
        81920,
        40,
        2039.0,
        312.0,
    ),
    card(
        "a6000",
        "NVIDIA RTX A6000",
        (8, 6),
        84,
        49140,
        6,
        768.0,
        155.0,
    ),
    card(
        "rtx4090",
        "NVIDIA GeForce RTX 4090",
        (8, 9),
        128,
        24564,
        72,
        1008.0,
        165.0,
    ),
    card("l40s", "NVIDIA L40S", (8, 9), 142, 46068, 96, 864.0, 362.0),
    card(
        "h100",
        "NVIDIA H100 80GB HBM3",
        (9, 0),
        132,
        81559,
        50,
        3350.0,
        989.0,
    ),
    card(
        "h200",
        "NVIDIA H200",
        (9, 0),
        132,
        143771,
        60,
        4800.0,
        989.0,
    ),
    card(
        "b200",
        "NVIDIA B200",
        (10, 0),
        148,
        183359,
        126,
        8000.0,
        2250.0,
    ),
    card(
        "rtx5090",
        "NVIDIA GeForce RTX 5090",
        (12, 0),
        170,
        32607,
        96,
        1792.0,
        210.0,
    ),
    card(
        "rtxpro6000",
        "NVIDIA RTX PRO 6000 Blackwell",
        (12, 0),
        188,
        97887,
        128,
        1792.0,
        250.0,
    ),
];

#[allow(clippy::too_many_arguments)]
const fn card(
    key: &'static str,
    name: &'static str,
    cc: (u32, u32),
    sms: u32,
    memory_mib: usize,
    l2_mib: usize,
    bandwidth_gbs: f64,
    bf16_tflops: f64,
) -> Card {
    Card {
        key,
        name,
        cc,
        sms,
        memory_mib,
        l2_mib,
        bandwidth_gbs,
        bf16_tflops,
    }
}

/// The card of a profile name (case-insensitive; `-`, `_` and spaces ignored), or an error
/// naming the known ones.
pub fn card_named(name: &str) -> Result<&'static Card, String> {
    let norm = |s: &str| {
        s.chars()
            .filter(|c| !matches!(c, '-' | '_' | ' '))
            .flat_map(char::to_lowercase)
            .collect::<String>()
    };
    let want = norm(name);
    CARDS.iter().find(|c| norm(c.key) == want).ok_or_else(|| {
        let known: Vec<_> = CARDS.iter().map(|c| c.key).collect();
        format!(
            "unknown device profile {name:?} (known: {})",
            known.join(", ")
        )
    })
}

/// Everything a launch plan needs to know of the GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceLimits {
    pub name: String,
    pub cc: (u32, u32),
    pub sms: u32,
    pub smem_per_sm: usize,
    /// Most shared memory one block may use, static + dynamic, after opting in.
    pub smem_per_block_optin: usize,
    /// Shared memory the system reserves per resident block.
    pub smem_reserved_per_block: usize,
    pub threads_per_sm: u32,
    pub max_blocks_per_sm: u32,
    pub regs_per_sm: u32,
    pub l2_bytes: usize,
    pub memory_bytes: usize,
    /// Memory bandwidth, GB/s (from the bus width and clock, or the card's datasheet).
    pub bandwidth_gbs: Option<f64>,
    /// `wgmma` and TMA (`sm_90a`) kernels may run.
    pub hopper_instructions: bool,
    /// The card these limits emulate (a device profile), if any.
    pub profile: Option<&'static str>,
}

impl DeviceLimits {
    /// The limits of `card`, as its driver would report them.
    pub fn of_card(card: &Card) -> Self {
        let a = arch_limits(card.cc).expect("every card of the table has a supported capability");
        Self {
            name: card.name.to_string(),
            cc: card.cc,
            sms: card.sms,
            smem_per_sm: a.smem_per_sm,
            smem_per_block_optin: a.smem_per_block_optin,
            smem_reserved_per_block: 1 << 10,
            threads_per_sm: a.threads_per_sm,
            max_blocks_per_sm: a.max_blocks_per_sm,
            regs_per_sm: a.regs_per_sm,
            l2_bytes: card.l2_mib << 20,
            memory_bytes: card.memory_mib << 20,
            bandwidth_gbs: Some(card.bandwidth_gbs),
            hopper_instructions: a.hopper_instructions,
            profile: None,
        }
    }

    /// The limits the driver reports for the context's device.
    pub fn from_driver(ctx: &Arc<CudaContext>) -> Result<Self, String> {
        let get = |a: A| {
            ctx.attribute(a)
                .map_err(|e| format!("reading device attribute {a:?}: {e:?}"))
        };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| format!("compute capability: {e:?}"))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let memory_bytes = ctx
            .total_mem()
            .map_err(|e| format!("device memory: {e:?}"))?;
        // Bus width (bits) × memory clock (kHz) × 2 (double data rate); a driver may leave
        // these out, then the card table's figure if the name is known.
        let bus = get(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH).unwrap_or(0);
        let clock_khz = get(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).unwrap_or(0);
        let bandwidth_gbs = if bus > 0 && clock_khz > 0 {
            Some(bus as f64 / 8.0 * clock_khz as f64 * 2.0 / 1e6)
        } else {
            CARDS
                .iter()
                .find(|c| c.name == name)
                .map(|c| c.bandwidth_gbs)
        };
        let cc = (major.max(0) as u32, minor.max(0) as u32);
        Ok(Self {
            name,
            cc,
            sms: get(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
            smem_per_sm: get(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)? as usize,
            smem_per_block_optin: get(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
                as usize,
            smem_reserved_per_block: get(A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK)
                .unwrap_or(1024) as usize,
            threads_per_sm: get(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)? as u32,
            max_blocks_per_sm: get(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR)? as u32,
            regs_per_sm: get(A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR)? as u32,
            l2_bytes: get(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize,
            memory_bytes,
            bandwidth_gbs,
            hopper_instructions: cc == (9, 0),
            profile: None,
        })
    }

    /// An error naming the GPU, its capability and the minimum, below 8.0.
    pub fn check_supported(&self) -> Result<(), String> {
        if self.cc < MIN_CAPABILITY {
            return Err(format!(
                "{} has compute capability {}.{}; sala's kernels need {}.{} or later (Ampere, \
                 Ada, Hopper, Blackwell)",
                self.name, self.cc.0, self.cc.1, MIN_CAPABILITY.0, MIN_CAPABILITY.1
            ));
        }
        Ok(())
    }

    /// The limits of `card` imposed on this device: its shared memory, threads per SM, SM
    /// count and memory size for every plan; Hopper instructions only where both have them.
    /// An error when this device cannot honour them (less shared memory or threads per SM
    /// than the card, or less memory).
    pub fn emulating(&self, card: &'static Card) -> Result<Self, String> {
        let want = Self::of_card(card);
        let short = [
            (
                "shared memory per block",
                self.smem_per_block_optin < want.smem_per_block_optin,
            ),
            ("shared memory per SM", self.smem_per_sm < want.smem_per_sm),
            ("threads per SM", self.threads_per_sm < want.threads_per_sm),
            ("registers per SM", self.regs_per_sm < want.regs_per_sm),
            ("memory", self.memory_bytes < want.memory_bytes),
        ];
        if let Some((what, _)) = short.iter().find(|(_, s)| *s) {
            return Err(format!(
                "device profile {}: {} has less {what} than the {} it would emulate",
                card.key, self.name, card.name
            ));
        }
        Ok(Self {
            name: format!("{} (as {})", self.name, card.name),
            hopper_instructions: want.hopper_instructions && self.hopper_instructions,
            profile: Some(card.key),
            ..want
        })
    }

    /// The NVRTC target for this device's kernels: `compute_90a` on Hopper, else its own.
    pub fn target(&self) -> String {
        target_for(self.cc)
    }

    /// Warps the device keeps resident at full occupancy.
    pub fn resident_warps(&self) -> usize {
        self.sms as usize * (self.threads_per_sm as usize / 32)
    }

    /// Blocks of `threads` threads using `regs` registers each and `smem` bytes of shared
    /// memory (static + dynamic) that fit on one SM at once (0: none fits).
    pub fn blocks_per_sm(&self, threads: u32, regs: u32, smem: usize) -> u32 {
        if threads == 0 || smem > self.smem_per_block_optin || threads > 1024 {
            return 0;
        }
        // Registers are allocated per warp in units of 256.
        let warps = threads.div_ceil(32);
        let regs_per_warp = (regs.max(1) * 32).div_ceil(256) * 256;
        let by_regs = self.regs_per_sm / (regs_per_warp * warps);
        let by_threads = self.threads_per_sm / (warps * 32);
        let by_smem = (self.smem_per_sm / (smem + self.smem_reserved_per_block)) as u32;
        by_regs
            .min(by_threads)
            .min(by_smem)
            .min(self.max_blocks_per_sm)
    }
}

/// The NVRTC virtual architecture for compute capability `cc`.
pub fn target_for(cc: (u32, u32)) -> String {
    if cc == (9, 0) {
        "compute_90a".into()
    } else {
        format!("compute_{}{}", cc.0, cc.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_card_has_limits_and_profiles_parse() {
        for c in CARDS {
            let l = DeviceLimits::of_card(c);
            assert!(l.smem_per_block_optin <= l.smem_per_sm, "{}", c.key);
            assert!(SUPPORTED.contains(&c.cc), "{}", c.key);
            assert_eq!(card_named(c.key).unwrap().key, c.key);
        }
        assert_eq!(card_named("RTX-5090").unwrap().key, "rtx5090");
        let e = card_named("rtx9090").unwrap_err();
        assert!(e.contains("rtx9090") && e.contains("rtx5090"), "{e}");
    }

    #[test]
    fn consumer_cards_allow_99_kib_and_1536_threads() {
        for key in ["a6000", "rtx4090", "l40s", "rtx5090", "rtxpro6000"] {
            let l = DeviceLimits::of_card(card_named(key).unwrap());
            assert_eq!(l.smem_per_block_optin, 99 << 10, "{key}");
            assert_eq!(l.threads_per_sm, 1536, "{key}");
            assert!(!l.hopper_instructions, "{key}");
        }
        assert!(DeviceLimits::of_card(card_named("h100").unwrap()).hopper_instructions);
    }

    #[test]
    fn a_profile_takes_the_cards_limits_and_needs_a_larger_device() {
        let h200 = DeviceLimits::of_card(card_named("h200").unwrap());
        let p = h200.emulating(card_named("rtx5090").unwrap()).unwrap();
        assert_eq!((p.sms, p.threads_per_sm), (170, 1536));
        assert_eq!(p.smem_per_block_optin, 99 << 10);
        assert_eq!(p.memory_bytes, 32607 << 20);
        assert!(!p.hopper_instructions && p.profile == Some("rtx5090"));
        let h100 = h200.emulating(card_named("h100").unwrap()).unwrap();
        assert!(h100.hopper_instructions);
        let small = DeviceLimits::of_card(card_named("rtx5090").unwrap());
        let e = small.emulating(card_named("h200").unwrap()).unwrap_err();
        assert!(e.contains("less shared memory per block"), "{e}");
    }

    #[test]
    fn below_ampere_is_a_clear_error() {
        let mut l = DeviceLimits::of_card(card_named("a100").unwrap());
        l.cc = (7, 5);
        l.name = "Tesla T4".into();
        let e = l.check_supported().unwrap_err();
        assert!(
            e.contains("Tesla T4") && e.contains("7.5") && e.contains("8.0"),
            "{e}"
        );
    }

    #[test]
    fn occupancy_counts_threads_registers_and_shared_memory() {
        let h200 = DeviceLimits::of_card(card_named("h200").unwrap());
        let rtx = DeviceLimits::of_card(card_named("rtx5090").unwrap());
        // 256 threads, 32 registers: threads bound (8 on 2048, 6 on 1536).
        assert_eq!(h200.blocks_per_sm(256, 32, 0), 8);
        assert_eq!(rtx.blocks_per_sm(256, 32, 0), 6);
        // 72 KiB blocks: 3 on 228 KiB, 1 on 128 KiB.
        assert_eq!(h200.blocks_per_sm(128, 128, 72 << 10), 3);
        assert_eq!(rtx.blocks_per_sm(128, 128, 72 << 10), 1);
        // More than the opt-in: none.
        assert_eq!(rtx.blocks_per_sm(128, 64, 100 << 10), 0);
    }
}
