//! Debug options: environment variables that inject delays and faults so that tests (and
//! operators reproducing a problem) can exercise the failure paths of a real job. None of them
//! is read by a normal run; each is documented in `docs/debugging.md`.

use std::time::Duration;

/// Sleeps this many milliseconds at the end of every training step on every rank: a slow step
/// on a fast machine, so that a signal or a kill sent "mid-run" lands while the run is still
/// running.
pub const STEP_DELAY_ENV: &str = "NDTRAIN_DEBUG_STEP_DELAY_MS";

/// The step delay asked for, if any (unparsable values are an error, not silently ignored).
pub fn step_delay() -> Result<Option<Duration>, String> {
    millis(STEP_DELAY_ENV)
}

/// Environment variable `var` as whole milliseconds, if set.
fn millis(var: &str) -> Result<Option<Duration>, String> {
    match std::env::var(var) {
        Err(_) => Ok(None),
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .map(|ms| Some(Duration::from_millis(ms)))
            .map_err(|_| format!("{var}={v:?}: expected a whole number of milliseconds")),
    }
}

/// Runs the training loop on the host as it runs on a device: the host backend's buffers are
/// treated as device memory (every host access — initialisation, loading, checkpoints, checks —
/// is staged through copies) and the groups' collectives are staged through host buffers
/// apart from the "device" ones. Any layout. A test holds this path, which a GPU runs, to the
/// host's own without a GPU.
pub const DEVICE_PATH_ENV: &str = "NDTRAIN_DEBUG_DEVICE_PATH";

pub fn device_path() -> bool {
    std::env::var(DEVICE_PATH_ENV).is_ok_and(|v| v != "0")
}

/// The GPUs every rank sees, instead of asking CUDA: `UUID:NUMA,UUID:NUMA,…` (`NUMA` a node
/// number, or `?` where unknown); `{node_rank}` in a UUID becomes the rank's node-local rank, as
/// under one GPU per task. The decision of `run::gpus` — which GPU each rank takes, whether the
/// node's ranks share GPUs — then runs on any build and any device, and the placement table
/// shows it: a host test of it on real ranks (and pretend nodes).
pub const GPUS_ENV: &str = "NDTRAIN_DEBUG_GPUS";

/// The injected GPU list of `GPUS_ENV` as rank `node_rank` of its node sees it, if set.
pub fn injected_gpus(node_rank: usize) -> Result<Option<Vec<crate::backend::GpuInfo>>, String> {
    let Ok(spec) = std::env::var(GPUS_ENV) else { return Ok(None) };
    parse_gpus(&spec, node_rank).map(Some).map_err(|e| format!("{GPUS_ENV}={spec:?}: {e}"))
}

fn parse_gpus(spec: &str, node_rank: usize) -> Result<Vec<crate::backend::GpuInfo>, String> {
    spec.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .enumerate()
        .map(|(ordinal, e)| {
            let (uuid, numa) = e.rsplit_once(':').ok_or_else(|| format!("{e:?} is not UUID:NUMA"))?;
            let numa_node = match numa.trim() {
                "?" => None,
                n => Some(n.parse().map_err(|_| format!("{e:?}: NUMA node {n:?} is not a number or ?"))?),
            };
            let uuid = uuid.trim().replace("{node_rank}", &node_rank.to_string());
            Ok(crate::backend::GpuInfo { ordinal, uuid, pci_bus_id: format!("0000:{:02x}:00.0", 0x10 + ordinal), numa_node })
        })
        .collect()
}

/// When writing the checkpoint of this step, world rank 0 aborts the job (`MPI_Abort`) once
/// the file is laid out and the writers have started on its data: a crash in the middle of a
/// checkpoint, which must leave the previous one intact.
pub const ABORT_DURING_CHECKPOINT_ENV: &str = "NDTRAIN_DEBUG_ABORT_DURING_CHECKPOINT";

/// The step whose checkpoint write is to be aborted, if any.
pub fn abort_during_checkpoint() -> Option<u64> {
    std::env::var(ABORT_DURING_CHECKPOINT_ENV).ok().and_then(|v| v.trim().parse().ok())
}

/// A fault to inject: on world rank `rank`, at training step `step` (1-based, as the logs
/// count), optionally naming a tensor. Written `step=3,rank=1[,tensor=NAME]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    pub step: u64,
    pub rank: usize,
    pub tensor: Option<String>,
}

/// Rank `rank` returns an error at the start of step `step` (an ordinary runtime error: the
/// job must end on every rank within seconds, naming the rank and the cause).
pub const FAIL_ENV: &str = "NDTRAIN_DEBUG_FAIL";

/// Rank `rank`'s backend reports a failed device operation when step `step` synchronises with
/// its device, as an asynchronous CUDA error surfaces there: the job must end on every rank
/// within seconds with that rank's message naming the device (exit 1).
pub const DEVICE_ERROR_ENV: &str = "NDTRAIN_DEBUG_DEVICE_ERROR";

/// Rank `rank` stops making progress at the start of step `step` (sleeps, as a rank stuck in
/// I/O would): the watchdog (`[run] watchdog_seconds`) must end the job.
pub const HANG_ENV: &str = "NDTRAIN_DEBUG_HANG";

/// Rank `rank` reports at the start of step `step` a failed communicator, as NCCL's
/// asynchronous error reports a peer that is gone, and waits in it as a rank inside NCCL would:
/// the watchdog, which polls the communicators, must end the job (exit 1) naming the rank
/// within its time.
pub const ASYNC_ERROR_ENV: &str = "NDTRAIN_DEBUG_ASYNC_ERROR";

/// Rank `rank` sets the first element of its gradient shard of `tensor` to NaN after the
/// gradients of step `step` are reduced: `[optim] on_nonfinite` decides what happens.
pub const NAN_GRAD_ENV: &str = "NDTRAIN_DEBUG_NAN_GRAD";

/// Rank `rank` fails its part of writing the checkpoint of step `step` (as a full disk
/// would): the write is abandoned on every rank and the previous checkpoint stays intact.
pub const CHECKPOINT_WRITE_ERROR_ENV: &str = "NDTRAIN_DEBUG_CHECKPOINT_WRITE_ERROR";

/// Every rank's checkpoint writer sleeps this many milliseconds before each tensor it writes:
/// a slow file system, so that a kill lands while a write is in flight.
pub const CHECKPOINT_WRITE_DELAY_ENV: &str = "NDTRAIN_DEBUG_CHECKPOINT_WRITE_DELAY_MS";

/// The writer's delay per tensor, if `CHECKPOINT_WRITE_DELAY_ENV` is set.
pub fn checkpoint_write_delay() -> Result<Option<Duration>, String> {
    millis(CHECKPOINT_WRITE_DELAY_ENV)
}

/// The fault described by environment variable `var`, if it is set.
pub fn fault(var: &str) -> Result<Option<Fault>, String> {
    match std::env::var(var) {
        Err(_) => Ok(None),
        Ok(v) => parse_fault(&v).map(Some).map_err(|e| format!("{var}={v:?}: {e}")),
    }
}

fn parse_fault(spec: &str) -> Result<Fault, String> {
    let (mut step, mut rank, mut tensor) = (None, None, None);
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once('=').ok_or_else(|| format!("{part:?} is not key=value"))?;
        let number = || v.trim().parse::<u64>().map_err(|_| format!("{k} = {v:?} is not a whole number"));
        match k.trim() {
            "step" => step = Some(number()?),
            "rank" => rank = Some(number()? as usize),
            "tensor" => tensor = Some(v.trim().to_string()),
            other => return Err(format!("unknown field {other:?} (expected step, rank, tensor)")),
        }
    }
    let step = step.ok_or("missing step=N (1-based)")?;
    if step == 0 {
        return Err("step counts from 1".into());
    }
    Ok(Fault { step, rank: rank.unwrap_or(0), tensor })
}

impl Fault {
    /// Whether the fault fires on world rank `rank` at 1-based step `step`.
    pub fn fires(&self, rank: usize, step: u64) -> bool {
        self.rank == rank && self.step == step
    }
}

/// Whether `f` is set and fires on world rank `rank` at 1-based step `step`.
pub fn fires(f: &Option<Fault>, rank: usize, step: u64) -> bool {
    f.as_ref().is_some_and(|f| f.fires(rank, step))
}

/// Every fault a run injects, read from the environment once at its start (a malformed value
/// is an error before the first step).
#[derive(Clone, Debug, Default)]
pub struct Faults {
    pub step_delay: Option<Duration>,
    pub fail: Option<Fault>,
    pub hang: Option<Fault>,
    pub async_error: Option<Fault>,
    pub nan_grad: Option<Fault>,
    pub device_error: Option<Fault>,
    pub checkpoint_write_error: Option<Fault>,
    pub checkpoint_write_delay: Option<Duration>,
}

impl Faults {
    pub fn from_env() -> Result<Faults, String> {
        Ok(Faults {
            step_delay: step_delay()?,
            fail: fault(FAIL_ENV)?,
            hang: fault(HANG_ENV)?,
            async_error: fault(ASYNC_ERROR_ENV)?,
            nan_grad: fault(NAN_GRAD_ENV)?,
            device_error: fault(DEVICE_ERROR_ENV)?,
            checkpoint_write_error: fault(CHECKPOINT_WRITE_ERROR_ENV)?,
            checkpoint_write_delay: checkpoint_write_delay()?,
        })
    }

    /// At the start of step `s1` on world rank `rank`: the injected failure (an error), hang
    /// (this rank sleeps for good, as a rank stuck in I/O would) or asynchronous communicator
    /// error (reported to the watchdog's checks, then waited in for good).
    pub fn at_step_start(&self, rank: usize, s1: u64) -> Result<(), String> {
        if fires(&self.fail, rank, s1) {
            return Err(format!("injected failure ({FAIL_ENV}) at step {s1}"));
        }
        if fires(&self.async_error, rank, s1) {
            let check = super::watchdog::add_check(move || {
                Some(format!("communicator of group world: injected asynchronous error ({ASYNC_ERROR_ENV}) at step {s1}"))
            });
            std::mem::forget(check);
            sleep_for_good();
        }
        if fires(&self.hang, rank, s1) {
            eprintln!("rank {rank}: {HANG_ENV} at step {s1}: this rank stops making progress");
            sleep_for_good();
        }
        Ok(())
    }
}

fn sleep_for_good() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn injected_gpu_lists_parse_or_say_what_is_wrong() {
        let g = parse_gpus("GPU-a:0, GPU-{node_rank}:?", 3).unwrap();
        assert_eq!((g[0].uuid.as_str(), g[0].numa_node, g[0].ordinal), ("GPU-a", Some(0), 0));
        assert_eq!((g[1].uuid.as_str(), g[1].numa_node, g[1].ordinal), ("GPU-3", None, 1));
        assert!(parse_gpus("GPU-a", 0).unwrap_err().contains("UUID:NUMA"));
        assert!(parse_gpus("GPU-a:x", 0).unwrap_err().contains("not a number"));
    }

    #[test]
    fn fault_specs_parse_or_say_what_is_wrong() {
        assert_eq!(parse_fault("step=3,rank=1").unwrap(), Fault { step: 3, rank: 1, tensor: None });
        let f = parse_fault(" step = 2 , tensor=model.norm.weight ").unwrap();
        assert_eq!((f.step, f.rank, f.tensor.as_deref()), (2, 0, Some("model.norm.weight")));
        assert!(parse_fault("rank=1").unwrap_err().contains("missing step"));
        assert!(parse_fault("step=0").unwrap_err().contains("from 1"));
        assert!(parse_fault("step=x").unwrap_err().contains("whole number"));
        assert!(parse_fault("step=1,when=now").unwrap_err().contains("unknown field"));
        assert!(parse_fault("step").unwrap_err().contains("key=value"));
        assert!(fires(&Some(Fault { step: 3, rank: 1, tensor: None }), 1, 3));
        assert!(!fires(&Some(Fault { step: 3, rank: 1, tensor: None }), 0, 3));
        assert!(!fires(&None, 0, 1));
    }
}
