//! NCCL on the GPUs of this machine (`sala_cuda::nccl`): a group over every GPU sums each
//! rank's buffer in place; over one GPU, the buffer stays as it was.

use cudarc::driver::{CudaContext, DevicePtr};

/// Rank r's f32 buffer holds r + 1 + (i mod 1000) / 1000 at i: after the sum, every rank holds
/// the ranks' total; 1, 2 and all GPUs (one and two where the machine has fewer).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn an_nccl_group_sums_every_ranks_buffer() {
    sala_cuda::libs::ensure_loaded().unwrap();
    let gpus = CudaContext::device_count().unwrap() as usize;
    for ranks in [1, gpus.min(2), gpus] {
        let ordinals: Vec<i32> = (0..ranks as i32).collect();
        let group = sala_cuda::nccl::Group::all(&ordinals).unwrap();
        assert_eq!(group.ranks(), ranks);
        let n = 4099;
        let value = |r: usize, i: usize| (r + 1) as f32 + (i % 1000) as f32 / 1000.0;
        let streams: Vec<_> = (0..ranks)
            .map(|r| CudaContext::new(r).unwrap().default_stream())
            .collect();
        let bufs: Vec<_> = streams
            .iter()
            .enumerate()
            .map(|(r, s)| {
                let host: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
                s.clone_htod(&host).unwrap()
            })
            .collect();
        let ptrs: Vec<(u64, *mut std::ffi::c_void)> = bufs
            .iter()
            .zip(&streams)
            .map(|(b, s)| (b.device_ptr(s).0, s.cu_stream() as *mut std::ffi::c_void))
            .collect();
        group
            .all_reduce_sum(sala_cuda::nccl::Elem::F32, &ptrs, n)
            .unwrap();
        for (r, (b, s)) in bufs.iter().zip(&streams).enumerate() {
            let got = s.clone_dtoh(b).unwrap();
            for (i, g) in got.iter().enumerate() {
                let want: f32 = (0..ranks).map(|q| value(q, i)).sum();
                assert!(
                    (g - want).abs() <= 1e-5 * want,
                    "{ranks} ranks, rank {r}, {i}: {g} vs {want}"
                );
            }
        }
        // A group of the wrong size is refused by name.
        assert!(group
            .all_reduce_sum(sala_cuda::nccl::Elem::F32, &ptrs[..ranks - 1], n)
            .unwrap_err()
            .contains("buffers"));
    }
}
