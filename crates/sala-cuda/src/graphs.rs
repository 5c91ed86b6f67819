//! CUDA graphs of decode steps, piecewise. A step of up to [`GRAPH_MAX_ROWS`] rows that repeats
//! one seen before (the same spans of the same sequences, over the same scratch buffers) is
//! captured the second time it runs and replayed from then on: one graph for each stretch of
//! work between two sparse attentions, whose grids and arguments move with the caches' lengths
//! every step, so they run eagerly in between. What a replay reads that changes from step to
//! step lives in device buffers written before the graphs run: the token ids and each row's
//! position ([`StepGraphs::begin`]'s caller uploads them). While replaying, the host still walks
//! the step's ops, launching nothing inside a stretch; each stretch must walk as many launches
//! as its capture did, or the step is an error.

use cudarc::driver::{sys, CudaGraph, CudaStream};
use sala_model::{BResult, BackendError};
use std::collections::HashMap;
use std::sync::Arc;

/// Steps of up to this many rows (decode steps) are captured and replayed.
pub const GRAPH_MAX_ROWS: usize = 64;

/// Captured steps kept (each a few graphs); past it they are all dropped.
const MAX_RECORDED: usize = 32;

/// Steps remembered as seen once; past it they are forgotten.
const MAX_SEEN: usize = 4096;

/// A step's identity for replay: its spans (first row, length), its sequences, the logits each
/// span asks for, the rows kept for drafts, and the scratch buffers' addresses and sizes (a
/// grown buffer moves).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct StepKey {
    pub spans: Vec<(usize, usize)>,
    pub seqs: Vec<u64>,
    pub logits: Vec<u8>,
    pub aux_rows: Vec<[usize; 4]>,
    pub scratch: u64,
}

/// How the step under way launches its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Kernels launch as the ops ask.
    Eager,
    /// Each stretch is captured into a graph, which is then launched.
    Capture,
    /// Each stretch's launches are skipped and its recorded graph launched instead.
    Replay,
}

/// The graphs of one step, stretch by stretch (none for a stretch without work), with each
/// stretch's launch count.
struct Recording {
    graphs: Vec<Option<CudaGraph>>,
    launches: Vec<usize>,
}

/// Captured steps and the step under way.
pub(crate) struct StepGraphs {
    stream: Arc<CudaStream>,
    /// Steps run eagerly once, waiting for their second time to be captured.
    seen: std::collections::HashSet<StepKey>,
    recorded: HashMap<StepKey, Recording>,
    /// Set after a capture or a replay failed: every later step runs eagerly.
    broken: bool,
    mode: Mode,
    key: Option<StepKey>,
    /// The stretch under way (its index), and whether one is open.
    stretch: usize,
    open: bool,
    /// The launcher's count when the open stretch began.
    start: usize,
    /// No stretch opens until [`StepGraphs::release`] (another GPU's eager work under way).
    held: bool,
    /// Set by the first hold: other GPUs' captures may be under way in this thread, so
    /// captures are relaxed (a thread-local one would refuse the other GPUs' allocations).
    shared_thread: bool,
    capture: Option<Recording>,
    captured: usize,
    replayed: usize,
}

impl StepGraphs {
    pub fn new(stream: Arc<CudaStream>) -> Self {
        Self {
            stream,
            seen: Default::default(),
            recorded: HashMap::new(),
            broken: false,
            mode: Mode::Eager,
            key: None,
            stretch: 0,
            open: false,
            start: 0,
            held: false,
            shared_thread: false,
            capture: None,
            captured: 0,
            replayed: 0,
        }
    }

    /// Steps captured and steps replayed so far.
    pub fn stats(&self) -> (usize, usize) {
        (self.captured, self.replayed)
    }

    /// Whether launches are skipped now (a replayed stretch is open).
    pub fn skipping(&self) -> bool {
        self.mode == Mode::Replay && self.open
    }

    /// The step's mode, and whether a stretch is open.
    pub fn state(&self) -> (Mode, bool) {
        (self.mode, self.open)
    }

    /// Closes the open stretch and keeps the next from opening until [`StepGraphs::release`]
    /// (also across [`StepGraphs::begin`]).
    pub fn hold(&mut self, launched: usize) -> BResult<()> {
        self.held = true;
        self.shared_thread = true;
        self.pause(launched)
    }

    /// Ends [`StepGraphs::hold`]: the next stretch opens.
    pub fn release(&mut self, launched: usize) -> BResult<()> {
        self.held = false;
        self.resume(launched)
    }

    /// Decides the mode of a step (`None`: not a graph step) and opens its first stretch.
    /// `launched` is the launcher's count of launches so far.
    pub fn begin(&mut self, key: Option<StepKey>, launched: usize) -> BResult<Mode> {
        self.mode = Mode::Eager;
        self.key = None;
        self.stretch = 0;
        self.open = false;
        let Some(key) = key.filter(|_| !self.broken) else {
            return Ok(Mode::Eager);
        };
        self.mode = if self.recorded.contains_key(&key) {
            Mode::Replay
        } else if self.seen.contains(&key) {
            self.capture = Some(Recording {
                graphs: Vec::new(),
                launches: Vec::new(),
            });
            Mode::Capture
        } else {
            self.seen.insert(key.clone());
            Mode::Eager
        };
        self.key = Some(key);
        self.resume(launched)?;
        Ok(self.mode)
    }

    /// Closes the open stretch: a captured one is instantiated and launched, a replayed one's
    /// graph launched. Work after it runs eagerly until [`StepGraphs::resume`].
    pub fn pause(&mut self, launched: usize) -> BResult<()> {
        if !self.open {
            return Ok(());
        }
        self.open = false;
        let launches = launched - self.start;
        match self.mode {
            Mode::Eager => Ok(()),
            Mode::Capture => {
                let graph = match self.stream.end_capture(sys::CUgraphInstantiate_flags(0)) {
                    Ok(g) => g,
                    Err(e) => return Err(self.fail(format!("ending a capture: {e:?}"))),
                };
                if let Some(g) = &graph {
                    g.launch()
                        .map_err(|e| BackendError(format!("launching a captured graph: {e:?}")))?;
                } else if launches > 0 {
                    return Err(self.fail("a capture of launches gave no graph".into()));
                }
                let rec = self.capture.as_mut().expect("capturing");
                rec.graphs.push(graph);
                rec.launches.push(launches);
                Ok(())
            }
            Mode::Replay => {
                let key = self.key.clone().expect("replaying");
                let at = self.stretch;
                let want = self.recorded[&key].launches.get(at).copied();
                if want != Some(launches) {
                    return Err(self.fail(format!(
                        "replay of a decode step: stretch {at} walked {launches} launches, its \
                         capture {want:?}"
                    )));
                }
                if let Some(g) = &self.recorded[&key].graphs[at] {
                    g.launch()
                        .map_err(|e| BackendError(format!("launching a recorded graph: {e:?}")))?;
                }
                self.stretch += 1;
                Ok(())
            }
        }
    }

    /// Opens the next stretch after eager work (not while held).
    pub fn resume(&mut self, launched: usize) -> BResult<()> {
        if self.open || self.held || self.mode == Mode::Eager {
            return Ok(());
        }
        self.open = true;
        self.start = launched;
        if self.mode == Mode::Capture {
            let mode = if self.shared_thread {
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED
            } else {
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            };
            self.stream
                .begin_capture(mode)
                .map_err(|e| self.fail(format!("beginning a capture: {e:?}")))?;
        }
        Ok(())
    }

    /// Ends the step: closes the open stretch and, after a capture, keeps its graphs unless
    /// the scratch buffers moved meanwhile (`scratch`: their fingerprint now). After an error
    /// (`ok` false) a capture under way is ended and dropped.
    pub fn end(&mut self, ok: bool, launched: usize, scratch: u64) -> BResult<()> {
        let closed = if ok {
            self.pause(launched)
        } else {
            if self.mode == Mode::Capture && self.open {
                let _ = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            }
            self.open = false;
            Ok(())
        };
        self.held = false;
        let mode = std::mem::replace(&mut self.mode, Mode::Eager);
        let key = self.key.take();
        let capture = self.capture.take();
        if !ok || closed.is_err() {
            return closed;
        }
        match (mode, key) {
            (Mode::Capture, Some(key)) if key.scratch == scratch => {
                if self.recorded.len() >= MAX_RECORDED {
                    self.recorded.clear();
                }
                self.recorded.insert(key, capture.expect("capturing"));
                self.captured += 1;
            }
            (Mode::Replay, Some(key)) => {
                let stretches = self.recorded[&key].launches.len();
                if self.stretch != stretches {
                    return Err(self.fail(format!(
                        "replay of a decode step walked {} stretches, its capture {stretches}",
                        self.stretch
                    )));
                }
                self.replayed += 1;
            }
            _ => {}
        }
        if self.seen.len() >= MAX_SEEN {
            self.seen.clear();
        }
        Ok(())
    }

    /// Forgets every captured step (their buffers moved or their sequences ended).
    pub fn clear(&mut self) {
        self.seen.clear();
        self.recorded.clear();
    }

    /// Marks graphs unusable from now on and names what failed.
    fn fail(&mut self, what: String) -> BackendError {
        self.broken = true;
        self.clear();
        BackendError(format!(
            "CUDA graphs: {what}; later steps run without graphs"
        ))
    }
}
