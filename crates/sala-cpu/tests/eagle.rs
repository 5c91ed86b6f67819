//! The EAGLE-3 draft model on the CPU backend against a plain implementation of its layer
//! written here (f32 sums, bf16 roundings where the draft's ops round): the hidden states it
//! reads the prompt into and the tokens it drafts.

use sala_checkpoint::{preset, write_random_draft, DraftCheckpoint, DraftConfig};
use sala_cpu::CpuBackend;
use sala_model::draft::DraftModel;
use sala_model::numerics::{bf16_round, rel_l2, rope_inv_freq, TestRng};
use sala_model::{Backend, Model};

/// `round(x Wᵀ)` for rows of `x` (`[n, k]`) and `w` (`[m, k]`).
fn product(x: &[f32], w: &[f32], k: usize) -> Vec<f32> {
    let m = w.len() / k;
    x.chunks_exact(k)
        .flat_map(|row| {
            (0..m).map(move |j| {
                let s: f32 = row
                    .iter()
                    .zip(&w[j * k..(j + 1) * k])
                    .map(|(a, b)| a * b)
                    .sum();
                bf16_round(s)
            })
        })
        .collect()
}

fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| bf16_round(x + y)).collect()
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    x.chunks_exact(w.len())
        .flat_map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
            let r = 1.0 / (ms + eps).sqrt();
            row.iter()
                .zip(w)
                .map(move |(v, g)| bf16_round(bf16_round(v * r) * g))
        })
        .collect()
}

/// Columns `from..to` of a `[rows, cols]` matrix.
fn columns(w: &[f32], cols: usize, from: usize, to: usize) -> Vec<f32> {
    w.chunks_exact(cols)
        .flat_map(|r| r[from..to].to_vec())
        .collect()
}

struct Reference {
    c: DraftConfig,
    t: std::collections::HashMap<String, Vec<f32>>,
    to_target: Vec<u32>,
    /// The draft's keys (rotated) and values so far, one row per position read.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl Reference {
    fn new(d: &DraftCheckpoint) -> Self {
        let mut t = std::collections::HashMap::new();
        for (name, layer) in [
            ("embed_tokens.weight", false),
            ("fc.weight", false),
            ("norm.weight", false),
            ("lm_head.weight", false),
            ("input_layernorm.weight", true),
            ("hidden_norm.weight", true),
            ("post_attention_layernorm.weight", true),
            ("self_attn.q_proj.weight", true),
            ("self_attn.k_proj.weight", true),
            ("self_attn.v_proj.weight", true),
            ("self_attn.o_proj.weight", true),
            ("mlp.gate_proj.weight", true),
            ("mlp.up_proj.weight", true),
            ("mlp.down_proj.weight", true),
        ] {
            t.insert(name.to_string(), d.tensor(name, layer).unwrap().to_f32());
        }
        Self {
            c: d.config().clone(),
            t,
            to_target: d.draft_to_target().unwrap(),
            keys: Vec::new(),
            values: Vec::new(),
        }
    }

    fn w(&self, name: &str) -> &[f32] {
        &self.t[name]
    }

    /// `fc` of the three hidden states (`[n, T]` each), as three products added.
    fn fc(&self, aux: &[Vec<f32>; 3]) -> Vec<f32> {
        let th = self.c.target_hidden_size;
        let fc = self.w("fc.weight");
        let part = |i: usize| product(&aux[i], &columns(fc, 3 * th, i * th, (i + 1) * th), th);
        add(&add(&part(0), &part(1)), &part(2))
    }

    /// The layer over `g` (`[n, H]`) and `tokens` at positions `pos..`: the output hidden
    /// states and the draft's pick for the last row.
    fn layer(&mut self, g: Vec<f32>, tokens: &[u32], pos: usize) -> (Vec<f32>, u32) {
        let c = self.c.clone();
        let (h, d, eps) = (c.hidden_size, c.head_dim, c.rms_norm_eps as f32);
        let n = tokens.len();
        let e: Vec<f32> = tokens
            .iter()
            .flat_map(|&t| {
                self.w("embed_tokens.weight")[t as usize * h..(t as usize + 1) * h].to_vec()
            })
            .collect();
        let xe = rms_norm(&e, self.w("input_layernorm.weight"), eps);
        let xh = rms_norm(&g, self.w("hidden_norm.weight"), eps);
        let proj = |name: &str| {
            let w = self.w(name);
            add(
                &product(&xe, &columns(w, 2 * h, 0, h), h),
                &product(&xh, &columns(w, 2 * h, h, 2 * h), h),
            )
        };
        let (mut q, mut k, v) = (
            proj("self_attn.q_proj.weight"),
            proj("self_attn.k_proj.weight"),
            proj("self_attn.v_proj.weight"),
        );
        let inv = rope_inv_freq(d, c.rope_theta);
        for (x, w) in [
            (&mut q, c.num_attention_heads * d),
            (&mut k, c.num_key_value_heads * d),
        ] {
            for (r, row) in x.chunks_exact_mut(w).enumerate() {
                let p = (pos + r) as f32;
                for head in row.chunks_exact_mut(d) {
                    let old = head.to_vec();
                    for i in 0..d / 2 {
                        let (cos, sin) = ((p * inv[i]).cos(), (p * inv[i]).sin());
                        head[i] = bf16_round(old[i] * cos - old[i + d / 2] * sin);
                        head[i + d / 2] = bf16_round(old[i + d / 2] * cos + old[i] * sin);
                    }
                }
            }
        }
        let kvw = c.num_key_value_heads * d;
        for r in 0..n {
            self.keys.push(k[r * kvw..(r + 1) * kvw].to_vec());
            self.values.push(v[r * kvw..(r + 1) * kvw].to_vec());
        }
        // Causal attention over every key read (the draft's cache, then these rows).
        let qw = c.num_attention_heads * d;
        let group = c.num_attention_heads / c.num_key_value_heads;
        let first = self.keys.len() - n;
        let mut o = vec![0f32; n * qw];
        for r in 0..n {
            for hh in 0..c.num_attention_heads {
                let g = hh / group;
                let qv = &q[r * qw + hh * d..r * qw + (hh + 1) * d];
                let seen = first + r + 1;
                let s: Vec<f32> = (0..seen)
                    .map(|j| {
                        let kv = &self.keys[j][g * d..(g + 1) * d];
                        qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() / (d as f32).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let p: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f32 = p.iter().sum();
                for i in 0..d {
                    let acc: f32 = (0..seen).map(|j| p[j] * self.values[j][g * d + i]).sum();
                    o[r * qw + hh * d + i] = bf16_round(acc / z);
                }
            }
        }
        let g = add(&g, &product(&o, self.w("self_attn.o_proj.weight"), qw));
        let a = rms_norm(&g, self.w("post_attention_layernorm.weight"), eps);
        let gate = product(&a, self.w("mlp.gate_proj.weight"), h);
        let up = product(&a, self.w("mlp.up_proj.weight"), h);
        let act: Vec<f32> = gate
            .iter()
            .zip(&up)
            .map(|(&x, &u)| bf16_round(bf16_round(x / (1.0 + (-x).exp())) * u))
            .collect();
        let g = add(
            &g,
            &product(&act, self.w("mlp.down_proj.weight"), c.intermediate_size),
        );
        let last = rms_norm(&g[(n - 1) * h..], self.w("norm.weight"), eps);
        let logits = product(&last, self.w("lm_head.weight"), h);
        let best = logits
            .iter()
            .enumerate()
            .fold(0, |b, (i, &x)| if x > logits[b] { i } else { b });
        (g, self.to_target[best])
    }
}

/// The tiny target (dense attention throughout) and a random draft reading its layers 0, 2 and
/// the last, from a checkpoint written in a temporary folder.
struct Tiny {
    config: sala_checkpoint::ModelConfig,
    draft_config: DraftConfig,
    target: Model<CpuBackend>,
    ckpt: DraftCheckpoint,
    draft: DraftModel<CpuBackend>,
    _dir: tempfile::TempDir,
}

fn tiny(be: &CpuBackend) -> Tiny {
    let mut config = preset("tiny").unwrap();
    config.sparse.dense_len = 4096;
    let target = Model::random(be, config.clone(), 3, &mut |_, _| {}).unwrap();
    let draft_config = DraftConfig {
        intermediate_size: 96,
        aux_layers: [0, 2, config.num_hidden_layers - 1],
        ..DraftConfig::small(&config)
    };
    let dir = tempfile::tempdir().unwrap();
    write_random_draft(dir.path(), &draft_config, true, None, 17).unwrap();
    let ckpt = DraftCheckpoint::open(dir.path(), &config).unwrap();
    let draft = DraftModel::load(be, &target, &ckpt).unwrap();
    Tiny {
        config,
        draft_config,
        target,
        ckpt,
        draft,
        _dir: dir,
    }
}

#[test]
fn the_draft_reads_the_prompt_and_drafts_as_its_plain_layer_does() {
    let be = CpuBackend::default();
    let Tiny {
        config,
        draft_config: c,
        target,
        ckpt,
        draft,
        _dir,
    } = tiny(&be);
    let mut rng = TestRng::new(8);
    for (len, drafts) in [(1usize, 1usize), (37, 1), (37, 4), (90, 3)] {
        let prompt: Vec<u32> = (0..len)
            .map(|_| rng.below(config.vocab_size) as u32)
            .collect();
        let mut seq = target.new_sequence(&be).unwrap();
        seq.aux = Some(draft.capture(&be, &target, 0).unwrap());
        let mut ws = target.workspace(&be, 64).unwrap();
        target
            .prefill(&be, &mut ws, &mut seq, &prompt, &mut |_| {})
            .unwrap();
        let aux: [Vec<f32>; 3] = std::array::from_fn(|i| {
            let all = be.to_host(&seq.aux.as_ref().unwrap().bufs[i]).unwrap();
            all[..len * config.hidden_size].to_vec()
        });
        let feed = rng.below(config.vocab_size) as u32;
        let tokens: Vec<u32> = prompt.iter().copied().chain([feed]).collect();
        let mut state = draft.new_state(&be, &target).unwrap();
        let mut dws = draft.workspace(&be).unwrap();
        let got = draft
            .propose(
                &be, &target, &mut dws, &mut state, &mut seq, &tokens, drafts,
            )
            .unwrap();

        let mut reference = Reference::new(&ckpt);
        let (mut g, mut pick) = reference.layer(reference.fc(&aux), &tokens[1..], 0);
        if drafts == 1 {
            let hidden = draft.last_hidden(&be, &dws).unwrap();
            let err = rel_l2(&hidden[..g.len()], &g);
            assert!(err < 1e-2, "prompt of {len}: hidden states off by {err}");
        }
        let mut want = vec![pick];
        while want.len() < drafts {
            let h = c.hidden_size;
            let last = g[g.len() - h..].to_vec();
            (g, pick) = reference.layer(last, &[pick], len + want.len() - 1);
            want.push(pick);
        }
        // Random weights: near-ties are rare but possible; the first draft must agree.
        assert_eq!(got.len(), drafts, "prompt of {len}");
        assert_eq!(got[0], want[0], "prompt of {len}: first draft");
        let agree = got.iter().zip(&want).filter(|(a, b)| a == b).count();
        assert!(
            agree + 1 >= drafts,
            "prompt of {len}: drafts {got:?}, plain layer {want:?}"
        );
        // The draft keeps only what it read from the target.
        let again = draft
            .propose(
                &be, &target, &mut dws, &mut state, &mut seq, &tokens, drafts,
            )
            .unwrap();
        assert!(again.is_empty(), "nothing new read, yet drafts {again:?}");
    }
}

/// A draft reading the target's last layer keeps every row of its sequence's prompt, even in a
/// step where another prompt's chunk asks for no logits (so the last layer packs the rows it
/// reads to the front): the hidden states it captures and the prompt's last logits are those of
/// reading the prompt alone, bit for bit.
#[test]
fn a_draft_reads_every_last_layer_row_beside_a_chunk_that_reads_none() {
    use sala_model::{LogitRows, StepInput, StepLogits};
    let be = CpuBackend::default();
    let Tiny {
        config,
        target,
        draft,
        _dir,
        ..
    } = tiny(&be);
    let mut rng = TestRng::new(9);
    let mut tokens = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| rng.below(config.vocab_size) as u32)
            .collect()
    };
    let (other, prompt) = (tokens(20), tokens(37));
    let mut ws = target.workspace(&be, 64).unwrap();
    let captured = |seq: &sala_model::SeqState<CpuBackend>| -> Vec<Vec<f32>> {
        let aux = seq.aux.as_ref().unwrap();
        aux.bufs
            .iter()
            .map(|b| be.to_host(b).unwrap()[..prompt.len() * config.hidden_size].to_vec())
            .collect()
    };
    let mut alone = target.new_sequence(&be).unwrap();
    alone.aux = Some(draft.capture(&be, &target, 0).unwrap());
    let want = target
        .prefill(&be, &mut ws, &mut alone, &prompt, &mut |_| {})
        .unwrap();
    let mut beside = target.new_sequence(&be).unwrap();
    beside.aux = Some(draft.capture(&be, &target, 0).unwrap());
    let mut plain = target.new_sequence(&be).unwrap();
    let mode = target.sparse_mode(prompt.len());
    let mut inputs = [
        StepInput {
            mode: target.sparse_mode(other.len()),
            seq: &mut plain,
            tokens: &other,
            logits: LogitRows::None,
        },
        StepInput {
            seq: &mut beside,
            tokens: &prompt,
            mode,
            logits: LogitRows::Last,
        },
    ];
    let got = target.forward(&be, &mut ws, &mut inputs).unwrap();
    let got = got.into_iter().nth(1).map(StepLogits::into_rows).unwrap();
    assert!(
        got == want,
        "the prompt's last logits beside the chunk differ"
    );
    assert!(
        captured(&beside) == captured(&alone),
        "the draft's hidden states beside the chunk differ"
    );
}
