//! The device layout of a 4-bit matrix (`gemv/w4.cu`, "Held slab-major"): one record for each
//! M-tile of 16 rows and slab of 128 inputs, the tile's words for the slab in the order a warp's
//! lanes load them and then its rows' group words, so a warp's slab is one contiguous kilobyte
//! and two loads of consecutive 16 bytes a lane.

use sala_model::memory::{w4_group_slots, w4_record_words};

/// Rows of an M-tile, inputs of a slab.
const TILE: usize = 16;
const SLAB: usize = 128;

/// Where row `r`'s word `j` (inputs 8j..8j + 7) lies in the records of a matrix of `cols`
/// inputs in groups of `group`.
pub fn w4_word_index(r: usize, j: usize, cols: usize, group: usize) -> usize {
    let (slab, jj) = (j / 16, j % 16);
    let (rr, quarter) = (r % TILE, jj / 4);
    record_start(r, slab, cols, group) + (rr / 8) * 128 + ((rr % 8) * 4 + quarter) * 4 + jj % 4
}

/// Where row `r`'s group word for input `i` (a multiple of 32) lies.
pub fn w4_group_index(r: usize, i: usize, cols: usize, group: usize) -> usize {
    let slots = w4_group_slots(group);
    let quarter = (i % SLAB) / 32;
    record_start(r, i / SLAB, cols, group) + 256 + (r % TILE) * slots + quarter % slots
}

fn record_start(r: usize, slab: usize, cols: usize, group: usize) -> usize {
    ((r / TILE) * (cols / SLAB) + slab) * w4_record_words(group)
}

/// Words of the records of a `[rows, cols]` matrix.
pub fn w4_records_len(rows: usize, cols: usize, group: usize) -> usize {
    rows.div_ceil(TILE) * (cols / SLAB) * w4_record_words(group)
}

/// The records of `rows` rows of `cols` inputs: `words` (`[rows, cols / 8]`, nibbles
/// interleaved) and `group_words` (`[rows, cols / group]`); padding rows are zero.
pub fn w4_records(
    words: &[u32],
    group_words: &[u32],
    rows: usize,
    cols: usize,
    group: usize,
) -> Vec<u32> {
    let (per_row, groups) = (cols / 8, cols / group);
    let mut out = vec![0u32; w4_records_len(rows, cols, group)];
    for r in 0..rows {
        // A 32-input quarter's 4 words stay together (w4_word_index of its first word on).
        for (j, quarter) in words[r * per_row..(r + 1) * per_row]
            .chunks_exact(4)
            .enumerate()
        {
            let at = w4_word_index(r, 4 * j, cols, group);
            out[at..at + 4].copy_from_slice(quarter);
        }
        for i in (0..cols).step_by(32) {
            if w4_group_slots(group) == 1 && i % SLAB != 0 {
                continue;
            }
            out[w4_group_index(r, i, cols, group)] = group_words[r * groups + i / group];
        }
    }
    out
}

/// The words and group words of the first `rows` rows of `records` (what [`w4_records`] packed).
pub fn w4_unrecord(
    records: &[u32],
    rows: usize,
    cols: usize,
    group: usize,
) -> (Vec<u32>, Vec<u32>) {
    let (per_row, groups) = (cols / 8, cols / group);
    let mut words = Vec::with_capacity(rows * per_row);
    let mut group_words = Vec::with_capacity(rows * groups);
    for r in 0..rows {
        words.extend((0..per_row).map(|j| records[w4_word_index(r, j, cols, group)]));
        group_words.extend((0..groups).map(|g| records[w4_group_index(r, g * group, cols, group)]));
    }
    (words, group_words)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(n: usize, seed: &mut u64) -> Vec<u32> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (*seed >> 32) as u32
            })
            .collect()
    }

    /// Every word and group word lands in its own place, inside the records, and comes back.
    #[test]
    fn records_round_trip_for_every_group_shape() {
        let mut seed = 7;
        for (rows, cols, group) in [
            (16, 128, 128),
            (40, 256, 32),
            (33, 384, 64),
            (8, 512, 256),
            (50, 1024, 1024),
            (17, 768, 96),
            (24, 640, 160),
        ] {
            let words = random(rows * cols / 8, &mut seed);
            let groups = random(rows * cols / group, &mut seed);
            let rec = w4_records(&words, &groups, rows, cols, group);
            assert_eq!(rec.len(), w4_records_len(rows, cols, group));
            let mut seen = vec![false; rec.len()];
            for r in 0..rows {
                for j in 0..cols / 8 {
                    let at = w4_word_index(r, j, cols, group);
                    assert!(!seen[at], "{rows}x{cols}/{group}: word ({r}, {j}) overlaps");
                    seen[at] = true;
                }
            }
            let (w, g) = w4_unrecord(&rec, rows, cols, group);
            assert_eq!(w, words, "{rows}x{cols}/{group}: words");
            assert_eq!(g, groups, "{rows}x{cols}/{group}: group words");
            // Each 32-input quarter of a row finds the group word of its own group.
            for r in 0..rows {
                for i in (0..cols).step_by(32) {
                    let want = groups[r * (cols / group) + i / group];
                    assert_eq!(rec[w4_group_index(r, i, cols, group)], want);
                }
            }
        }
    }

    /// A lane's two 16-byte loads: lane (g, t) finds rows g and g + 8's words 4t..4t + 3 of
    /// the slab at 128h + 4·lane, as `gemv_w4_body` reads them.
    #[test]
    fn a_lane_finds_its_rows_in_consecutive_words() {
        let (cols, group) = (512, 128);
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            for h in 0..2 {
                for slab in 0..cols / 128 {
                    for e in 0..4 {
                        let at = w4_word_index(16 + g + 8 * h, slab * 16 + 4 * t + e, cols, group);
                        let start = ((cols / 128) + slab) * w4_record_words(group);
                        assert_eq!(at, start + 128 * h + 4 * lane + e);
                    }
                }
            }
        }
    }
}
