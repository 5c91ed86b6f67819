//! Context parallelism on the GPU (`sala_model::context`): ranks as CUDA backends sharing
//! this machine's first GPU (copies within it: `OneDevice`), and on two GPUs through NCCL
//! where there are two; the scan's kernels (`lightning_state_advance`,
//! `lightning_state_term`) and the cache appends checked through whole prefills.

use super::*;
use sala_cuda::context::{NcclExchange, OneDevice};
use sala_model::context::Exchange;
use sala_model::context::{prefill, ContextRank};

/// The tiny model's prompt of 40 (dense) and 150 (sparse) tokens read by 1, 2 and 3 ranks
/// sharing the first GPU, and by 2 ranks on two GPUs through NCCL where there are two, each
/// rank its whole range at once or in chunks of 37 or 12 rows, gives one GPU's last logits
/// (1 rank reading its range at once bit for bit; otherwise within the lightning scan's
/// rounding and the norms a chunked rank makes apart from the residual adds), and decoding on
/// the last rank goes on as one GPU's does.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn context_parallel_prefill_on_the_gpu_gives_one_gpus_logits() {
    let mut config = preset("tiny").unwrap();
    config.sparse.dense_len = 100;
    let g = gpu();
    let one = Model::random(&g, config.clone(), 61, &mut |_, _| {}).unwrap();
    let mut rng = TestRng::new(62);
    let mut failed = Vec::new();
    // Spans of at most 17 rows step token by token on the GPU, q and k normed and rotated
    // inside the stepping kernels (40 tokens over 3 ranks: ranges of 16, 16 and 8 rows;
    // chunks of 12 rows): the start-state term must prepare its queries itself.
    for (n, chunk) in [(40usize, 40usize), (150, 150), (150, 37), (150, 12)] {
        let toks = random_tokens(&mut rng, n + 4, config.vocab_size);
        let (prompt, rest) = toks.split_at(n);
        let mut ws = one.workspace(&g, chunk).unwrap();
        let mut seq = one.new_sequence(&g).unwrap();
        let mut want = vec![one
            .prefill(&g, &mut ws, &mut seq, prompt, &mut |_| {})
            .unwrap()];
        for &t in rest {
            want.push(one.decode(&g, &mut ws, &mut seq, t).unwrap());
        }
        let two_gpus = CudaBackend::device_count().unwrap() >= 2;
        eprintln!(
            "context parallel over 2 GPUs (NCCL): {}",
            if two_gpus { "run" } else { "not run: one GPU" }
        );
        let nccl = two_gpus.then(|| NcclExchange::new(&[0, 1]).unwrap());
        let mut cases: Vec<(Vec<usize>, &dyn Exchange<CudaBackend>)> = vec![
            (vec![0], &OneDevice),
            (vec![0, 0], &OneDevice),
            (vec![0, 0, 0], &OneDevice),
        ];
        if let Some(n) = &nccl {
            cases.push((vec![0, 1], n));
        }
        for (ordinals, exchange) in cases {
            let count = ordinals.len();
            let mut o = base_options();
            o.exact_select = true;
            let gpus: Vec<CudaBackend> = ordinals
                .iter()
                .map(|&k| CudaBackend::new(k, o.clone()).unwrap())
                .collect();
            let models: Vec<_> = gpus
                .iter()
                .map(|b| Model::random(b, config.clone(), 61, &mut |_, _| {}).unwrap())
                .collect();
            let mut wss: Vec<_> = models
                .iter()
                .zip(&gpus)
                .map(|(m, b)| m.workspace(b, chunk).unwrap())
                .collect();
            let mut seqs: Vec<_> = models
                .iter()
                .zip(&gpus)
                .map(|(m, b)| m.new_sequence(b).unwrap())
                .collect();
            let mut ranks = ContextRank::zip(&gpus, &models, &mut wss, &mut seqs);
            let done = prefill(&mut ranks, exchange, prompt).unwrap();
            drop(ranks);
            let last = done.last;
            let mut got = vec![done.logits];
            for &t in rest {
                got.push(
                    models[last]
                        .decode(&gpus[last], &mut wss[last], &mut seqs[last], t)
                        .unwrap(),
                );
            }
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                let what = format!(
                    "{n} tokens in chunks of {chunk} over ranks on GPUs {ordinals:?}, row {i}"
                );
                let e = rel_l2(a, b);
                eprintln!("{what}: relative L2 {e}");
                let bad = if count == 1 && chunk == n {
                    a != b
                } else {
                    e.is_nan() || e >= 5e-2
                };
                if bad {
                    failed.push(what);
                }
            }
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}
