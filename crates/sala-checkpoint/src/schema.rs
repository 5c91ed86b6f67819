//! The tensor schema: every tensor a checkpoint for a config holds, named by its role and
//! place ([`Role`], [`Place`], [`tensor_name`]), with its shape. The checkpoint validator, the
//! writer and the model builder all read it.

use crate::config::{MixerKind, ModelConfig};

/// What a tensor is in the model. With the layer it belongs to, it gives the tensor's name
/// ([`tensor_name`]): the one schema the checkpoint validator, the writer and the model builder
/// read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Embed,
    FinalNorm,
    LmHead,
    InputNorm,
    PostNorm,
    QProj,
    KProj,
    VProj,
    OProj,
    /// The mixer's output gate: `z_proj` in lightning layers, `o_gate` in sparse ones.
    OutputGate,
    QNorm,
    KNorm,
    ONorm,
    GateProj,
    UpProj,
    DownProj,
}

/// A tensor's place: the model's own, or layer `i`'s (of its mixer kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Model,
    Layer(usize, MixerKind),
}

/// The checkpoint name (HF layout) of `role` at `place`.
pub fn tensor_name(role: Role, place: Place) -> String {
    let rest = match role {
        Role::Embed => return "model.embed_tokens.weight".into(),
        Role::FinalNorm => return "model.norm.weight".into(),
        Role::LmHead => return "lm_head.weight".into(),
        Role::InputNorm => "input_layernorm.weight",
        Role::PostNorm => "post_attention_layernorm.weight",
        Role::QProj => "self_attn.q_proj.weight",
        Role::KProj => "self_attn.k_proj.weight",
        Role::VProj => "self_attn.v_proj.weight",
        Role::OProj => "self_attn.o_proj.weight",
        Role::OutputGate => match place {
            Place::Layer(_, MixerKind::Sparse) => "self_attn.o_gate.weight",
            _ => "self_attn.z_proj.weight",
        },
        Role::QNorm => "self_attn.q_norm.weight",
        Role::KNorm => "self_attn.k_norm.weight",
        Role::ONorm => "self_attn.o_norm.weight",
        Role::GateProj => "mlp.gate_proj.weight",
        Role::UpProj => "mlp.up_proj.weight",
        Role::DownProj => "mlp.down_proj.weight",
    };
    match place {
        Place::Layer(i, _) => format!("model.layers.{i}.{rest}"),
        Place::Model => rest.to_string(),
    }
}

/// A tensor the config requires: its name, shape (row-major, `[out, in]` for linears), role
/// and place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
    pub place: Place,
}

impl TensorSpec {
    pub fn new(role: Role, place: Place, shape: &[usize]) -> Self {
        Self {
            name: tensor_name(role, place),
            shape: shape.to_vec(),
            role,
            place,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Whether layers of `kind` under `config` hold a tensor of `role`.
fn layer_has(config: &ModelConfig, kind: MixerKind, role: Role) -> bool {
    let lightning = kind == MixerKind::Lightning;
    match role {
        Role::OutputGate if lightning => config.use_output_gate,
        Role::OutputGate => config.attn_use_output_gate,
        Role::QNorm | Role::KNorm => lightning && config.qk_norm,
        Role::ONorm => lightning && config.use_output_norm,
        Role::Embed | Role::FinalNorm | Role::LmHead => false,
        _ => true,
    }
}

/// The tensors of a layer of `kind`, in checkpoint order.
const LAYER_ROLES: [Role; 13] = [
    Role::InputNorm,
    Role::QProj,
    Role::KProj,
    Role::VProj,
    Role::OProj,
    Role::OutputGate,
    Role::QNorm,
    Role::KNorm,
    Role::ONorm,
    Role::PostNorm,
    Role::GateProj,
    Role::UpProj,
    Role::DownProj,
];

/// The tensors a checkpoint for `config` holds, in model order: embedding, layers 0.., final
/// norm, `lm_head` (absent when `tie_word_embeddings`).
pub fn expected_tensors(config: &ModelConfig) -> Vec<TensorSpec> {
    let h = config.hidden_size;
    let d = config.head_dim;
    let q = config.num_attention_heads * d;
    let i = config.intermediate_size;
    let mut out = vec![TensorSpec::new(
        Role::Embed,
        Place::Model,
        &[config.vocab_size, h],
    )];
    for (n, &kind) in config.mixer_types.iter().enumerate() {
        let kv = match kind {
            MixerKind::Sparse => config.kv_dim(),
            MixerKind::Lightning => config.lightning_kv_dim(),
        };
        for role in LAYER_ROLES {
            if !layer_has(config, kind, role) {
                continue;
            }
            let shape: &[usize] = match role {
                Role::InputNorm | Role::PostNorm => &[h],
                Role::QProj | Role::OutputGate => &[q, h],
                Role::KProj | Role::VProj => &[kv, h],
                Role::OProj => &[h, q],
                Role::QNorm | Role::KNorm => &[d],
                Role::ONorm => &[q],
                Role::GateProj | Role::UpProj => &[i, h],
                Role::DownProj => &[h, i],
                Role::Embed | Role::FinalNorm | Role::LmHead => unreachable!("model tensors"),
            };
            out.push(TensorSpec::new(role, Place::Layer(n, kind), shape));
        }
    }
    out.push(TensorSpec::new(Role::FinalNorm, Place::Model, &[h]));
    if !config.tie_word_embeddings {
        out.push(TensorSpec::new(
            Role::LmHead,
            Place::Model,
            &[config.vocab_size, h],
        ));
    }
    out
}

/// Parameters of a checkpoint for `config` (sum over [`expected_tensors`]).
pub fn expected_parameter_count(config: &ModelConfig) -> u64 {
    expected_tensors(config)
        .iter()
        .map(|t| t.numel() as u64)
        .sum()
}
