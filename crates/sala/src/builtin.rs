//! The built-in tiny model, used when no `--model` is given: written into the user's cache
//! directory (`$XDG_CACHE_HOME/sala`, else `~/.cache/sala`) in a folder named by a hash of
//! its files' content, so that a build which writes other files (a new chat template, a new
//! tokenizer) never runs an older build's.
//!
//! Each start writes the files afresh into a temporary folder beside it (about 2 MB, a tenth
//! of a second) and compares them with the cached folder's: a folder that differs (changed
//! by hand, or half written by an older scheme) is replaced. The new folder is renamed into
//! place whole, so that processes starting together never see half a model.

use anyhow::{bail, Context, Result};
use sala_checkpoint::{preset, DType};
use std::path::{Path, PathBuf};

/// The cache directory the built-in model is kept in.
fn cache_base() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("sala")
}

/// The built-in model's folder, written or checked first.
pub fn builtin_model() -> Result<PathBuf> {
    builtin_model_in(&cache_base())
}

/// The files of the folder `dir` (no subfolders), by name.
fn read_files(dir: &Path) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        files.push((name, std::fs::read(entry.path())?));
    }
    files.sort();
    Ok(files)
}

/// FNV-1a (64-bit) over the files' names, lengths and bytes: a name for their content.
fn content_hash(files: &[(String, Vec<u8>)]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for (name, bytes) in files {
        eat(name.as_bytes());
        eat(&(bytes.len() as u64).to_le_bytes());
        eat(bytes);
    }
    h
}

/// Whether `dir` holds exactly `files`.
fn holds(dir: &Path, files: &[(String, Vec<u8>)]) -> bool {
    read_files(dir).is_ok_and(|found| found == files)
}

/// [`builtin_model`] under `base`.
pub fn builtin_model_in(base: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(base).with_context(|| format!("creating {}", base.display()))?;
    let tmp = tempfile::Builder::new()
        .prefix(".builtin-tiny-")
        .tempdir_in(base)
        .with_context(|| format!("creating a folder in {}", base.display()))?;
    crate::write_checkpoint(
        tmp.path(),
        &preset("tiny")?,
        0,
        DType::Bf16,
        usize::MAX,
        false,
    )?;
    let files =
        read_files(tmp.path()).with_context(|| format!("reading back {}", tmp.path().display()))?;
    let dir = base.join(format!("builtin-tiny-{:016x}", content_hash(&files)));
    if holds(&dir, &files) {
        return Ok(dir);
    }
    if dir.exists() {
        // Not what this build writes: moved aside whole, then removed.
        let stale = tempfile::Builder::new()
            .prefix(".stale-builtin-tiny-")
            .tempdir_in(base)
            .with_context(|| format!("creating a folder in {}", base.display()))?;
        let aside = stale.path().join("model");
        if std::fs::rename(&dir, &aside).is_err() && dir.exists() && !holds(&dir, &files) {
            bail!("could not replace the built-in model in {}", dir.display());
        }
    }
    let written = tmp.keep();
    if std::fs::rename(&written, &dir).is_err() {
        // Another process put it in place first; its files are the same, or it is an error.
        let _ = std::fs::remove_dir_all(&written);
        if !holds(&dir, &files) {
            bail!("could not create the built-in model in {}", dir.display());
        }
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_is_named_by_content_and_a_changed_folder_is_replaced() {
        let base = tempfile::tempdir().unwrap();
        let dir = builtin_model_in(base.path()).unwrap();
        let files = read_files(&dir).unwrap();
        assert!(files.iter().any(|(n, _)| n == "tokenizer_config.json"));
        // The same files every time: the same folder, and nothing else left behind.
        assert_eq!(builtin_model_in(base.path()).unwrap(), dir);
        let entries: Vec<_> = std::fs::read_dir(base.path()).unwrap().collect();
        assert_eq!(entries.len(), 1, "{entries:?}");
        assert!(dir
            .file_name()
            .unwrap()
            .to_string_lossy()
            .ends_with(&format!("{:016x}", content_hash(&files))));

        // A stale chat template (an older build's, or edited) is replaced.
        let config = dir.join("tokenizer_config.json");
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
        v["chat_template"] = "{{ messages[0].content }}".into();
        std::fs::write(&config, v.to_string()).unwrap();
        std::fs::remove_file(dir.join("generation_config.json")).unwrap();
        assert!(!holds(&dir, &files));
        assert_eq!(builtin_model_in(base.path()).unwrap(), dir);
        assert_eq!(read_files(&dir).unwrap(), files);
        assert_eq!(std::fs::read_dir(base.path()).unwrap().count(), 1);
    }

    /// Processes starting together each see a whole model.
    #[test]
    fn starts_at_once_see_whole_models() {
        let base = tempfile::tempdir().unwrap();
        let dirs: Vec<PathBuf> = std::thread::scope(|s| {
            let runs: Vec<_> = (0..4)
                .map(|_| s.spawn(|| builtin_model_in(base.path()).unwrap()))
                .collect();
            runs.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let files = read_files(&dirs[0]).unwrap();
        assert!(files.len() >= 5);
        for d in &dirs {
            assert_eq!(d, &dirs[0]);
        }
        assert!(holds(&dirs[0], &files));
    }
}
