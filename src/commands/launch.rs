//! One process per GPU: `protrain train --backend cuda --gpus N` starts its N workers itself,
//! as torchrun's `--nproc-per-node` does, and a process started with torchrun's variables
//! (`RANK`, `WORLD_SIZE`, ...) is a worker.
//!
//! [`role`] decides what this process is. The launcher ([`run_workers`]) picks a free port
//! for the rendezvous on one node (or takes `--master` on several), starts the workers with
//! the same command line and each worker's variables ([`Launch::env`]), and waits for them
//! all: rank 0 prints to the terminal, the others are quiet (their standard output is
//! dropped, their standard error kept) unless they fail. When a worker fails, the launcher
//! kills the others (which would otherwise wait in a collective for the dead one) and fails
//! itself, naming the rank and showing the end of its error output: never a hang. A worker
//! bounds NCCL's communicator setup with a watchdog (`bounded`, built with the `cuda`
//! feature), since `ncclCommInitRank` has no timeout of its own.
//!
//! `PROTRAIN_WORKER_PROBE=DIR` (for the launcher's tests, which need no GPU): a worker writes
//! its launch variables to `DIR/rank-R.env` and exits before any CUDA call; with
//! `PROTRAIN_WORKER_PROBE_FAIL=R`, rank `R` fails instead and the others wait, as a rank
//! blocked in a collective waits for a dead peer, until the launcher stops them.

use protrain::runtime::rendezvous::{self, Launch};
use protrain::runtime::RuntimeError;
use protrain::{Error, Result};
use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
#[cfg(feature = "cuda")]
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The variable that makes a worker report its launch instead of training (tests).
pub const PROBE: &str = "PROTRAIN_WORKER_PROBE";
/// The variable naming the rank that a probing worker fails on (tests).
pub const PROBE_FAIL: &str = "PROTRAIN_WORKER_PROBE_FAIL";

/// How much of a quiet worker's standard error the launcher keeps to show when it fails.
const KEPT_ERROR_BYTES: usize = 16 * 1024;
/// How often the launcher looks at its workers.
const POLL: Duration = Duration::from_millis(50);
/// How long a worker gives NCCL's communicator setup after the rendezvous (which every rank
/// has passed, so all are alive) before it gives up.
#[cfg(feature = "cuda")]
const NCCL_INIT_GRACE: Duration = Duration::from_secs(120);

/// The flags of a run on several nodes (torchrun's `--node-rank`, `--master-addr` and
/// `--master-port`); `--gpus` and `--nodes` are the compile flags.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct NodeArgs {
    /// This node's rank among --nodes, from 0; the same command runs on every node with its
    /// own --node-rank (--backend cuda only) [default: 0].
    #[arg(long, value_name = "I")]
    pub node_rank: Option<u32>,
    /// Where rank 0 (worker 0 of --node-rank 0) listens for the other ranks, as HOST:PORT:
    /// needed with --nodes above 1, the same on every node (--backend cuda only) [default on
    /// one node: 127.0.0.1 and a free port].
    #[arg(long, value_name = "HOST:PORT")]
    pub master: Option<String>,
}

/// What this process is in a run.
#[derive(Debug, PartialEq, Eq)]
pub enum Role {
    /// The whole run (one GPU, or the host backend's ranks as threads).
    Single,
    /// The launcher of this node's workers, one per GPU: their launches, in local rank order.
    Launcher(Vec<Launch>),
    /// One rank of a multi-process run.
    Worker(Launch),
}

/// What a `train` process is, from its backend, `--gpus`, `--nodes`, the node flags and its
/// environment (`var` looks a variable up): a worker when torchrun's variables say so (on
/// the CUDA backend), a launcher when the CUDA backend runs on more than one GPU, else the
/// whole run. Errors name the flag or variable at fault and the way out.
pub fn role(
    cuda: bool,
    gpus: Option<u32>,
    nodes: Option<u32>,
    node: &NodeArgs,
    var: impl Fn(&str) -> Option<String>,
) -> Result<Role> {
    let (gpus, nodes) = (gpus.unwrap_or(1) as usize, nodes.unwrap_or(1) as usize);
    if !cuda {
        if node.node_rank.is_some() || node.master.is_some() {
            return Err(Error::Usage(
                "--node-rank and --master start a run on several nodes, one process per GPU, \
                 which only --backend cuda does; the host backend runs its ranks as threads of \
                 one process, so leave them out"
                    .into(),
            ));
        }
        return Ok(Role::Single);
    }
    if let Some(launch) = Launch::from_vars(&var)? {
        let compiled = gpus.saturating_mul(nodes);
        if launch.world_size != compiled {
            return Err(Error::Usage(format!(
                "{}={} but --gpus {gpus} x --nodes {nodes} = {compiled}; pass every rank the \
                 --gpus (per node) and --nodes its launcher was given",
                rendezvous::WORLD_SIZE,
                launch.world_size
            )));
        }
        return Ok(match launch.world_size {
            1 => Role::Single,
            _ => Role::Worker(launch),
        });
    }
    let node_rank = node.node_rank.unwrap_or(0) as usize;
    let master = match (&node.master, nodes) {
        (Some(master), _) => master.clone(),
        (None, 1) => format!("127.0.0.1:{}", free_port()?),
        (None, _) => {
            return Err(Error::Usage(format!(
                "--nodes {nodes} needs --master HOST:PORT, where worker 0 of --node-rank 0 \
                 listens for the other ranks: the first node's address and a free TCP port, \
                 the same on every node"
            )))
        }
    };
    let launches = (0..gpus.max(1))
        .map(|local| Launch::for_node(nodes, node_rank, gpus, local, &master))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(match launches[0].world_size {
        1 => Role::Single,
        _ => Role::Launcher(launches),
    })
}

/// A TCP port that is free on this machine now, for rank 0's rendezvous on one node.
fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map_err(|e| {
            RuntimeError::Launch(format!(
                "no free TCP port on 127.0.0.1 for the rendezvous ({e}); pass --master \
                 127.0.0.1:PORT with a port you know is free"
            ))
        })?;
    Ok(listener.port())
}

/// One started worker.
struct Worker {
    launch: Launch,
    child: Child,
    /// The end of its standard error (quiet workers only).
    error: Option<ErrorTail>,
}

/// The last [`KEPT_ERROR_BYTES`] a quiet worker wrote to its standard error, kept by a
/// reader thread (which also keeps the pipe from filling up and blocking the worker).
struct ErrorTail {
    kept: Arc<Mutex<Vec<u8>>>,
    reader: std::thread::JoinHandle<()>,
}

/// Starts this node's workers (`launches`), each this program with this command line and its
/// launch variables, and waits for all of them. Fails, after stopping the others, as soon as
/// one fails, naming its rank and showing the end of its error output.
pub fn run_workers(launches: &[Launch]) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| {
        Error::Launcher(format!(
            "cannot find this program to start its workers ({e}); start one process per GPU \
             with torchrun instead, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and \
             MASTER_PORT"
        ))
    })?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let mut workers: Vec<Worker> = Vec::with_capacity(launches.len());
    for launch in launches {
        let loud = launch.rank == 0;
        let mut command = Command::new(&exe);
        command
            .args(&args)
            .envs(launch.env())
            .stdin(Stdio::null())
            .stdout(if loud {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .stderr(if loud {
                Stdio::inherit()
            } else {
                Stdio::piped()
            });
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                stop(&mut workers);
                return Err(Error::Launcher(format!(
                    "cannot start the worker of rank {} ({}: {e}); check that the program is \
                     still there and that the system allows {} more processes",
                    launch.rank,
                    exe.display(),
                    launches.len()
                )));
            }
        };
        let error = child.stderr.take().map(|mut pipe| {
            let kept = Arc::new(Mutex::new(Vec::new()));
            let sink = Arc::clone(&kept);
            let reader = std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let mut kept = sink.lock().unwrap_or_else(|p| p.into_inner());
                    kept.extend_from_slice(&buf[..n]);
                    let excess = kept.len().saturating_sub(KEPT_ERROR_BYTES);
                    kept.drain(..excess);
                }
            });
            ErrorTail { kept, reader }
        });
        workers.push(Worker {
            launch: launch.clone(),
            child,
            error,
        });
    }
    let mut done = vec![false; workers.len()];
    loop {
        for (i, w) in workers.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            let status = w.child.try_wait().map_err(|e| {
                Error::Launcher(format!(
                    "cannot tell whether the worker of rank {} is still running ({e})",
                    w.launch.rank
                ))
            });
            match status {
                Ok(None) => {}
                Ok(Some(status)) if status.success() => done[i] = true,
                Ok(Some(status)) => {
                    let failed = i;
                    stop(&mut workers);
                    return Err(failure(&mut workers[failed], status, launches.len()));
                }
                Err(e) => {
                    stop(&mut workers);
                    return Err(e);
                }
            }
        }
        if done.iter().all(|&d| d) {
            return Ok(());
        }
        std::thread::sleep(POLL);
    }
}

/// Kills every worker still running and reaps them all.
fn stop(workers: &mut [Worker]) {
    for w in workers.iter_mut() {
        if let Ok(None) = w.child.try_wait() {
            let _ = w.child.kill();
        }
    }
    for w in workers.iter_mut() {
        let _ = w.child.wait();
    }
}

/// The launcher's error for worker `w`, which exited with `status`.
fn failure(w: &mut Worker, status: ExitStatus, count: usize) -> Error {
    let output = match w.error.take() {
        Some(ErrorTail { kept, reader }) => {
            // The worker is dead, so its pipe is closed and the reader ends.
            let _ = reader.join();
            let kept = kept.lock().unwrap_or_else(|p| p.into_inner());
            let text = String::from_utf8_lossy(&kept).trim().to_string();
            match text.is_empty() {
                true => " (it printed nothing)".to_string(),
                false => format!(":\n{text}"),
            }
        }
        None => " (its error is above)".to_string(),
    };
    Error::Launcher(format!(
        "the worker of rank {} (local rank {}) failed ({status}), so the launcher stopped the \
         other {} of this node{output}",
        w.launch.rank,
        w.launch.local_rank,
        count - 1
    ))
}

/// A worker under [`PROBE`]: writes its launch variables to `DIR/rank-R.env` and returns, or
/// fails when it is the rank [`PROBE_FAIL`] names, or waits (until the launcher stops it)
/// when another rank is to fail. `None` when not probing.
pub fn probe(launch: &Launch) -> Option<Result<()>> {
    let dir = std::env::var_os(PROBE)?;
    let fail = std::env::var(PROBE_FAIL)
        .ok()
        .and_then(|r| r.trim().parse::<usize>().ok());
    Some(match fail {
        Some(rank) if rank == launch.rank => Err(Error::Launcher(format!(
            "rank {rank} failed as {PROBE_FAIL} asked"
        ))),
        Some(_) => {
            std::thread::sleep(Duration::from_secs(600));
            Ok(())
        }
        None => {
            let text: String = launch
                .env()
                .iter()
                .map(|(name, value)| format!("{name}={value}\n"))
                .collect();
            let path = std::path::Path::new(&dir).join(format!("rank-{}.env", launch.rank));
            std::fs::write(&path, text).map_err(|source| Error::Write { path, source })
        }
    })
}

/// Runs `work` (NCCL's communicator setup), ending the process with an error naming `what`
/// and the rank when it takes longer than the rendezvous timeout plus [`NCCL_INIT_GRACE`]:
/// NCCL's `ncclCommInitRank` waits for every rank without a timeout of its own, and a worker
/// must never hang (the launcher then stops the other workers of its node).
#[cfg(feature = "cuda")]
pub fn bounded<T>(launch: &Launch, what: &str, work: impl FnOnce() -> T) -> T {
    let limit = rendezvous::DEFAULT_TIMEOUT + NCCL_INIT_GRACE;
    let (done, watch) = mpsc::channel::<()>();
    let (rank, what) = (launch.rank, what.to_string());
    let watchdog = std::thread::spawn(move || {
        if let Err(RecvTimeoutError::Timeout) = watch.recv_timeout(limit) {
            eprintln!(
                "error: rank {rank}: {what} did not finish within {} s although every rank \
                 reached the rendezvous; a rank died or its GPU hangs: see the other ranks' \
                 errors, or set NCCL_DEBUG=INFO",
                limit.as_secs()
            );
            std::process::exit(2);
        }
    });
    let out = work();
    drop(done);
    let _ = watchdog.join();
    out
}

/// This worker's collective: its GPU chosen (`LOCAL_RANK`), the rendezvous passed and NCCL's
/// communicator made, within the rendezvous timeout and then `bounded`.
#[cfg(feature = "cuda")]
pub fn join(launch: &Launch) -> Result<Box<dyn protrain::runtime::collective::Collective>> {
    use protrain::runtime::cuda::nccl::NcclRank;
    let what = "NCCL's communicator setup (ncclCommInitRank)";
    let rank = bounded(launch, what, || {
        NcclRank::connect(launch, rendezvous::DEFAULT_TIMEOUT)
    })?;
    Ok(Box::new(rank))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    fn node(rank: Option<u32>, master: Option<&str>) -> NodeArgs {
        NodeArgs {
            node_rank: rank,
            master: master.map(str::to_string),
        }
    }

    #[test]
    fn one_node_of_several_gpus_launches_a_worker_per_gpu_on_a_free_port() {
        let Role::Launcher(launches) =
            role(true, Some(3), None, &node(None, None), vars(&[])).expect("a launcher")
        else {
            panic!("three GPUs launch")
        };
        let ranks: Vec<(usize, usize, usize)> = launches
            .iter()
            .map(|l| (l.rank, l.local_rank, l.world_size))
            .collect();
        assert_eq!(ranks, [(0, 0, 3), (1, 1, 3), (2, 2, 3)]);
        assert!(launches.iter().all(|l| l.master_addr == "127.0.0.1"));
        assert!(launches
            .iter()
            .all(|l| l.master_port == launches[0].master_port));
    }

    #[test]
    fn a_node_of_several_takes_its_ranks_and_the_master() {
        let Role::Launcher(launches) = role(
            true,
            Some(2),
            Some(3),
            &node(Some(2), Some("node0:29500")),
            vars(&[]),
        )
        .expect("a launcher") else {
            panic!("six ranks launch")
        };
        let ranks: Vec<usize> = launches.iter().map(|l| l.rank).collect();
        assert_eq!(ranks, [4, 5]);
        assert_eq!(launches[1].master(), "node0:29500");
    }

    #[test]
    fn torchruns_variables_make_a_worker_and_the_host_backend_stays_threads() {
        let env = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29511"),
        ];
        let got = role(true, Some(2), None, &node(None, None), vars(&env)).expect("a worker");
        let Role::Worker(launch) = got else {
            panic!("{got:?}")
        };
        assert_eq!((launch.rank, launch.local_rank), (1, 1));
        assert_eq!(
            role(false, Some(2), None, &node(None, None), vars(&env)).expect("threads"),
            Role::Single
        );
        assert_eq!(
            role(true, None, None, &node(None, None), vars(&[])).expect("one GPU"),
            Role::Single
        );
    }

    #[test]
    fn bad_flags_name_the_flag_and_the_way_out() {
        let refused = |cuda, gpus, nodes, flags: NodeArgs, env: &[(&str, &str)], expected: &str| {
            let e = role(cuda, gpus, nodes, &flags, vars(env)).expect_err(expected);
            assert!(e.to_string().contains(expected), "{expected}: `{e}`");
        };
        refused(true, Some(0), None, node(None, None), &[], "--gpus 0");
        let (rank2, no_port) = (node(Some(2), Some("n:1")), node(None, Some("node0")));
        refused(
            true,
            Some(2),
            Some(2),
            rank2,
            &[],
            "--node-rank 2 is not below --nodes 2",
        );
        refused(
            true,
            Some(2),
            None,
            no_port,
            &[],
            "--master `node0` has no port",
        );
        refused(
            true,
            Some(2),
            Some(2),
            node(Some(1), None),
            &[],
            "needs --master",
        );
        refused(
            false,
            Some(2),
            None,
            node(Some(0), None),
            &[],
            "only --backend cuda",
        );
        let env = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ];
        refused(
            true,
            Some(4),
            None,
            node(None, None),
            &env,
            "WORLD_SIZE=2 but --gpus 4",
        );
    }
}
