//! Each rank's part of a weight: the rows and columns of its shard cut from the whole
//! tensor as it is uploaded, or made as one device's random weight holds them.

use super::{err, Ranks};
use crate::backend::{BResult, Backend, HostDType, HostTensor};
use crate::numerics::random_normal;
use crate::parallel::Shard;
use std::ops::Range;

/// Rows `rows` and columns `cols` of a row-major `[.., width]` array of `elem`-byte values;
/// with `own`, the columns outside it zero (all-zero bytes: 0 in every format here).
pub(super) fn cut_bytes(
    bytes: &[u8],
    elem: usize,
    width: usize,
    rows: &Range<usize>,
    cols: &Range<usize>,
    own: Option<&Range<usize>>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows.len() * cols.len() * elem);
    for r in rows.clone() {
        let row = &bytes[(r * width + cols.start) * elem..(r * width + cols.end) * elem];
        for (c, v) in cols.clone().zip(row.chunks_exact(elem)) {
            if own.is_none_or(|o| o.contains(&c)) {
                out.extend_from_slice(v);
            } else {
                out.extend(std::iter::repeat_n(0u8, elem));
            }
        }
    }
    out
}

impl<B: Backend> Ranks<B> {
    /// Rank `rank`'s part of a tensor: rows and columns of a matrix, entries of a vector.
    pub(super) fn upload_part<T>(
        &self,
        name: &str,
        t: HostTensor<'_>,
        part: &Shard,
        upload: impl Fn(HostTensor<'_>) -> BResult<T>,
    ) -> BResult<T> {
        let elem = match t.dtype {
            HostDType::F32 => 4,
            HostDType::Bf16 | HostDType::F16 => 2,
        };
        let (bytes, shape) = match *t.shape {
            [rows, cols] if part.rows.end <= rows && part.cols.end <= cols => (
                cut_bytes(
                    t.bytes,
                    elem,
                    cols,
                    &part.rows,
                    &part.cols,
                    part.own_cols.as_ref(),
                ),
                vec![part.rows.len(), part.cols.len()],
            ),
            [len] if part.rows.end <= len => (
                cut_bytes(t.bytes, elem, 1, &part.rows, &(0..1), None),
                vec![part.rows.len()],
            ),
            _ => {
                return Err(err(format!(
                    "weight {name}: shape {:?} does not hold rows {:?}, columns {:?}",
                    t.shape, part.rows, part.cols
                )))
            }
        };
        upload(HostTensor {
            dtype: t.dtype,
            shape: &shape,
            bytes: &bytes,
        })
    }

    /// The values `random_normal` gives a `[.., width]` tensor at rows `rows`, columns `cols`
    /// (what one device's random weight holds there), as f32 bytes.
    pub(super) fn random_part(
        width: usize,
        part: &Shard,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> Vec<u8> {
        let cols = part.cols.clone();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let rows: Vec<usize> = part.rows.clone().collect();
        let per = rows.len().div_ceil(threads).max(1);
        let mut out = vec![0u8; rows.len() * cols.len() * 4];
        std::thread::scope(|s| {
            for (chunk, dst) in rows.chunks(per).zip(out.chunks_mut(per * cols.len() * 4)) {
                let cols = cols.clone();
                s.spawn(move || {
                    let own = part.own_cols.clone();
                    let values = chunk.iter().flat_map(move |&r| {
                        let own = own.clone();
                        cols.clone().map(move |c| match &own {
                            Some(o) if !o.contains(&c) => 0.0,
                            _ => random_normal((r * width + c) as u64, seed, mean, std),
                        })
                    });
                    for (d, v) in dst.chunks_exact_mut(4).zip(values) {
                        d.copy_from_slice(&v.to_le_bytes());
                    }
                });
            }
        });
        out
    }
}
