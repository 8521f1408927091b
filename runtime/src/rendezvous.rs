//! Starting a multi-process run: torchrun's launch conventions, and the small TCP rendezvous
//! through which rank 0 hands every rank an opaque blob (the 128-byte NCCL unique id).
//!
//! A process learns its place in the run from a [`Launch`]: read from torchrun's environment
//! variables ([`Launch::from_env`]: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`), or made from the command line's `--nodes M --node-rank I --master HOST:PORT`
//! with `--gpus N` per node ([`Launch::for_node`]: rank = node rank * N + local rank). A
//! launcher that starts workers itself hands them the same variables ([`Launch::env`]).
//!
//! [`share_blob`] is the rendezvous. Rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other
//! rank connects, retrying until the deadline (rank 0 may start later), and introduces itself
//! with a magic number, the protocol version, its world size and its rank. Rank 0 refuses a
//! peer whose version or world size differs from its own, whose rank is out of range, or
//! whose rank another process already claimed, and then stops the whole rendezvous, telling
//! every rank that arrived why (naming both sides). A connection that does not introduce
//! itself as a protrain rank (a port scanner, another program) is dropped and ignored. Once
//! every rank has arrived, rank 0 sends each the blob. Every wait is bounded by the timeout
//! ([`DEFAULT_TIMEOUT`] unless the caller chooses): a rank that never comes, or that comes and
//! then dies, makes rank 0 fail with the list of missing ranks and send that list to every rank
//! that is still waiting; a rank 0 that dies makes the others fail when its connection closes.
//! No rank hangs. A world of one rank exchanges nothing and returns its own blob, so a
//! single-process run goes through the same code path.
//!
//! Only `std::net` is used. The rendezvous carries no secrets and authenticates nothing: like
//! torchrun's store, run it on a trusted network.

use crate::error::{NodeLaunchProblem, PortProblem, Result, RuntimeError};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The variable holding a process's global rank, as torchrun sets it.
pub const RANK: &str = "RANK";
/// The variable holding the number of ranks in the run.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// The variable holding a process's rank on its node, which is also its GPU's ordinal.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// The variable holding the host name or address of the node that runs rank 0.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// The variable holding the TCP port rank 0 listens on for the rendezvous.
pub const MASTER_PORT: &str = "MASTER_PORT";

/// torchrun's default rendezvous port, used when a world of one rank names none.
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// How long a rendezvous waits for every rank unless the caller chooses otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// The rendezvous wire protocol's version; ranks that speak another are refused.
pub const PROTOCOL_VERSION: u32 = 1;

/// The first bytes of every rendezvous message.
const MAGIC: [u8; 8] = *b"PTRDZV\r\n";
/// The largest blob rank 0 may hand out (the NCCL id is 128 bytes).
pub const MAX_BLOB: usize = 1 << 20;
/// How long rank 0 waits for a fresh connection to introduce itself.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// How much longer than the timeout a rank waits for rank 0's answer after connecting, so that
/// rank 0's own verdict (the blob, or which ranks are missing) arrives before it gives up.
const ANSWER_GRACE: Duration = Duration::from_secs(5);
/// The pause between polls of the listener and between connection attempts.
const POLL: Duration = Duration::from_millis(20);

/// A status byte of rank 0's answer: the blob follows.
const ANSWER_BLOB: u8 = 0;
/// A status byte of rank 0's answer: an explanation of why the rendezvous stopped follows.
const ANSWER_REFUSED: u8 = 1;

/// One process's place in a multi-process run, as torchrun describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// This process's rank, in `0..world_size`.
    pub rank: usize,
    /// The number of ranks (processes, one per GPU) in the run.
    pub world_size: usize,
    /// This process's rank on its node; its GPU's ordinal.
    pub local_rank: usize,
    /// The host name or address of the node that runs rank 0.
    pub master_addr: String,
    /// The port rank 0 listens on for the rendezvous.
    pub master_port: u16,
}

impl Launch {
    /// A run of one process on this machine: rank 0 of 1, GPU 0.
    pub fn single() -> Launch {
        Launch {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
        }
    }

    /// The launch described by this process's environment, `None` when none of `RANK`,
    /// `WORLD_SIZE` and `LOCAL_RANK` is set (a plain single-process run). See
    /// [`Launch::from_vars`] for what is checked.
    pub fn from_env() -> Result<Option<Launch>> {
        Launch::from_vars(|name| std::env::var(name).ok())
    }

    /// The launch described by `var` (a lookup of an environment variable by name), `None`
    /// when none of `RANK`, `WORLD_SIZE` and `LOCAL_RANK` is set. Once one is set, all three
    /// must be, as integers with `RANK < WORLD_SIZE` and `LOCAL_RANK < WORLD_SIZE`; with more
    /// than one rank `MASTER_ADDR` and `MASTER_PORT` must be set too (a world of one rank uses
    /// `127.0.0.1:29500`, which it never opens). Errors name the variable and the way out.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if [RANK, WORLD_SIZE, LOCAL_RANK]
            .iter()
            .all(|name| set(name).is_none())
        {
            return Ok(None);
        }
        let integer = |name: &str| -> Result<usize> {
            let value = set(name).ok_or_else(|| {
                RuntimeError::Launch(format!(
                    "{name} is not set, but {} is; a multi-process run needs all of {RANK}, \
                     {WORLD_SIZE} and {LOCAL_RANK} (torchrun sets them), a single-process run \
                     none of them",
                    [RANK, WORLD_SIZE, LOCAL_RANK]
                        .iter()
                        .filter(|n| set(n).is_some())
                        .copied()
                        .collect::<Vec<_>>()
                        .join(" and ")
                ))
            })?;
            value.trim().parse::<usize>().map_err(|_| {
                RuntimeError::Launch(format!(
                    "{name}=`{value}` is not a non-negative integer; set {name} to a number \
                     such as 0"
                ))
            })
        };
        let rank = integer(RANK)?;
        let world_size = integer(WORLD_SIZE)?;
        let local_rank = integer(LOCAL_RANK)?;
        if world_size == 0 {
            return Err(RuntimeError::Launch(format!(
                "{WORLD_SIZE}=0: a run needs at least one rank; set {WORLD_SIZE} to the number \
                 of processes (GPUs x nodes)"
            )));
        }
        for (name, value) in [(RANK, rank), (LOCAL_RANK, local_rank)] {
            if value >= world_size {
                return Err(RuntimeError::Launch(format!(
                    "{name}={value} is not below {WORLD_SIZE}={world_size}; ranks count from 0, \
                     so set {name} to at most {}",
                    world_size - 1
                )));
            }
        }
        let (master_addr, master_port) = if world_size == 1 {
            let single = Launch::single();
            let addr = set(MASTER_ADDR).unwrap_or(single.master_addr);
            let port = match set(MASTER_PORT) {
                Some(port) => parse_port(MASTER_PORT, &port)?,
                None => single.master_port,
            };
            (addr, port)
        } else {
            let addr = set(MASTER_ADDR).ok_or_else(|| {
                RuntimeError::Launch(format!(
                    "{MASTER_ADDR} is not set; set it to the host name or address of the node \
                     that runs rank 0 (torchrun sets it)"
                ))
            })?;
            let port = set(MASTER_PORT).ok_or_else(|| {
                RuntimeError::Launch(format!(
                    "{MASTER_PORT} is not set; set it to a free TCP port on the node that runs \
                     rank 0, the same on every rank (torchrun uses {DEFAULT_MASTER_PORT})"
                ))
            })?;
            (addr.trim().to_string(), parse_port(MASTER_PORT, &port)?)
        };
        Ok(Some(Launch {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        }))
    }

    /// The launch of worker `local_rank` of node `node_rank`, in a run of `nodes` nodes with
    /// `gpus` workers each, whose rank 0 listens at `master` (`HOST:PORT`, an IPv6 address in
    /// brackets): rank = `node_rank * gpus + local_rank`, world size = `nodes * gpus`. Errors
    /// name the setting at fault ([`RuntimeError::NodeLaunch`]).
    pub fn for_node(
        nodes: usize,
        node_rank: usize,
        gpus: usize,
        local_rank: usize,
        master: &str,
    ) -> Result<Launch> {
        let problem = |p| Err(RuntimeError::NodeLaunch(p));
        if nodes == 0 {
            return problem(NodeLaunchProblem::NoNodes);
        }
        if gpus == 0 {
            return problem(NodeLaunchProblem::NoWorkers);
        }
        if node_rank >= nodes {
            return problem(NodeLaunchProblem::NodeRank { node_rank, nodes });
        }
        if local_rank >= gpus {
            return problem(NodeLaunchProblem::LocalRank { local_rank, gpus });
        }
        let Some(world_size) = nodes.checked_mul(gpus) else {
            return problem(NodeLaunchProblem::Overflow { nodes, gpus });
        };
        let (master_addr, master_port) = parse_master(master)?;
        Ok(Launch {
            rank: node_rank * gpus + local_rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        })
    }

    /// The environment variables that describe this launch to a worker process, as torchrun
    /// sets them.
    pub fn env(&self) -> [(&'static str, String); 5] {
        [
            (RANK, self.rank.to_string()),
            (WORLD_SIZE, self.world_size.to_string()),
            (LOCAL_RANK, self.local_rank.to_string()),
            (MASTER_ADDR, self.master_addr.clone()),
            (MASTER_PORT, self.master_port.to_string()),
        ]
    }

    /// `MASTER_ADDR:MASTER_PORT`, for messages (an IPv6 address in brackets).
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// Splits rank 0's address, `HOST:PORT` (`[ADDR]:PORT` for IPv6), into host and port.
pub fn parse_master(master: &str) -> Result<(String, u16)> {
    let bad = |why: &'static str| {
        RuntimeError::NodeLaunch(NodeLaunchProblem::Master {
            master: master.to_string(),
            why,
        })
    };
    let (host, port) = master
        .trim()
        .rsplit_once(':')
        .ok_or_else(|| bad("has no port"))?;
    let host = match host.strip_prefix('[') {
        Some(inner) => inner
            .strip_suffix(']')
            .ok_or_else(|| bad("opens a bracket it does not close"))?,
        None if host.contains(':') => return Err(bad("is an IPv6 address without brackets")),
        None => host,
    };
    if host.is_empty() {
        return Err(bad("has no host"));
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| bad("has a port that is not a number from 1 to 65535"))?;
    if port == 0 {
        return Err(bad("has port 0"));
    }
    Ok((host.to_string(), port))
}

fn parse_port(name: &str, value: &str) -> Result<u16> {
    match value.trim().parse::<u16>() {
        Ok(port) if port != 0 => Ok(port),
        _ => Err(RuntimeError::Launch(format!(
            "{name}=`{value}` is not a TCP port; set {name} to a number from 1 to 65535, the \
             same on every rank"
        ))),
    }
}

/// The rendezvous: every rank of `launch`'s run gets the blob that rank 0 makes with `make`
/// (which only rank 0 calls). Waits at most `timeout` for the other ranks (a rank other than
/// 0 waits up to `timeout` for rank 0 to accept it, then for rank 0's answer a few seconds
/// longer than rank 0 waits, so rank 0's verdict arrives first). See the module doc for what
/// is refused and what every rank is told when a rank is missing.
pub fn share_blob(
    launch: &Launch,
    timeout: Duration,
    make: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    if launch.rank >= launch.world_size {
        return Err(RuntimeError::Launch(format!(
            "rank {} is not below the world size {}; ranks count from 0",
            launch.rank, launch.world_size
        )));
    }
    if u32::try_from(launch.world_size).is_err() {
        return Err(RuntimeError::Launch(format!(
            "a world of {} ranks is more than the rendezvous can count; pass the real number \
             of GPUs",
            launch.world_size
        )));
    }
    if launch.rank == 0 {
        let blob = make()?;
        if blob.len() > MAX_BLOB {
            return Err(RuntimeError::Rendezvous {
                rank: 0,
                problem: format!(
                    "the blob to share has {} bytes, more than the {MAX_BLOB} the protocol \
                     carries",
                    blob.len()
                ),
            });
        }
        if launch.world_size > 1 {
            serve(launch, timeout, &blob)?;
        }
        Ok(blob)
    } else {
        join(launch, timeout)
    }
}

/// What a rank says when it connects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Hello {
    version: u32,
    world: u32,
    rank: u32,
}

fn encode_hello(hello: Hello) -> [u8; 20] {
    let mut out = [0u8; 20];
    out[..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&hello.version.to_le_bytes());
    out[12..16].copy_from_slice(&hello.world.to_le_bytes());
    out[16..20].copy_from_slice(&hello.rank.to_le_bytes());
    out
}

/// `None` when the bytes are not a protrain rank's hello.
fn decode_hello(bytes: &[u8; 20]) -> Option<Hello> {
    if bytes[..8] != MAGIC {
        return None;
    }
    let word = |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    Some(Hello {
        version: word(8),
        world: word(12),
        rank: word(16),
    })
}

/// Rank 0's answer: magic, version, status, length, then the blob or a UTF-8 explanation.
fn write_answer(stream: &mut TcpStream, status: u8, body: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(body.len()).map_err(|_| ErrorKind::InvalidInput)?;
    let mut out = Vec::with_capacity(17 + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.push(status);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(body);
    stream.write_all(&out)?;
    stream.flush()
}

/// Whether a peer that rank 0 holds has closed its connection (died or gave up).
fn hung_up(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let mut byte = [0u8; 1];
    let gone = match stream.peek(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != ErrorKind::WouldBlock,
    };
    gone || stream.set_nonblocking(false).is_err()
}

/// Ranks listed for a message: `1, 3 and 4`.
fn list(ranks: &[usize]) -> String {
    match ranks {
        [] => String::new(),
        [one] => one.to_string(),
        [init @ .., last] => format!(
            "{} and {last}",
            init.iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Rank 0's side: accept every other rank, then hand each the blob.
fn serve(launch: &Launch, timeout: Duration, blob: &[u8]) -> Result<()> {
    let fail = |problem: String| RuntimeError::Rendezvous { rank: 0, problem };
    let master = launch.master();
    let addrs: Vec<SocketAddr> = (launch.master_addr.as_str(), launch.master_port)
        .to_socket_addrs()
        .map_err(|e| {
            fail(format!(
                "cannot resolve {MASTER_ADDR} `{}`: {e}; set it to a host name or address of \
                 this node, which runs rank 0",
                launch.master_addr
            ))
        })?
        .collect();
    let listener = TcpListener::bind(&addrs[..]).map_err(|e| {
        if e.kind() == ErrorKind::AddrInUse {
            return RuntimeError::RendezvousPort {
                rank: 0,
                problem: PortProblem::InUse {
                    master: master.clone(),
                    error: e.to_string(),
                },
            };
        }
        fail(format!(
            "cannot listen on {master}: {e}; {MASTER_ADDR} must name this node, which runs \
             rank 0, and {MASTER_PORT} a port this process may open"
        ))
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(format!("cannot poll the listener on {master}: {e}")))?;

    let world = launch.world_size;
    let deadline = Instant::now() + timeout;
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    // Stops the rendezvous: every rank that arrived hears why, and rank 0 returns it.
    let stop = |peers: &mut [Option<TcpStream>], problem: String| {
        let told = format!("rank 0 stopped the rendezvous: {problem}");
        for stream in peers.iter_mut().flatten() {
            // A peer that is gone cannot be told; the others still are.
            let _ = write_answer(stream, ANSWER_REFUSED, told.as_bytes());
        }
        fail(problem)
    };
    loop {
        for slot in peers.iter_mut() {
            if slot.as_ref().is_some_and(hung_up) {
                *slot = None;
            }
        }
        let missing: Vec<usize> = (1..world).filter(|&r| peers[r].is_none()).collect();
        if missing.is_empty() {
            break;
        }
        let now = Instant::now();
        if now >= deadline {
            let problem = format!(
                "rank(s) {} of {world} did not join (or joined and died) within {:.1} s; \
                 start every rank with {MASTER_ADDR}:{MASTER_PORT} = {master} and \
                 {WORLD_SIZE}={world}, and see the missing ranks' own output for why they \
                 failed",
                list(&missing),
                timeout.as_secs_f64()
            );
            return Err(stop(&mut peers, problem));
        }
        let (mut stream, from) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(POLL.min(deadline - now));
                continue;
            }
            Err(e) => {
                let problem = format!("accepting a connection on {master} failed: {e}");
                return Err(stop(&mut peers, problem));
            }
        };
        // A connection that does not introduce itself in time as a protrain rank is not one
        // of ours: drop it and keep waiting.
        let mut bytes = [0u8; 20];
        let hello = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(HELLO_TIMEOUT.min(deadline - now))))
            .and_then(|()| stream.read_exact(&mut bytes))
            .ok()
            .and_then(|()| decode_hello(&bytes));
        let Some(hello) = hello else { continue };
        let refusal = if hello.version != PROTOCOL_VERSION {
            Some(format!(
                "the process at {from} speaks rendezvous protocol {} but rank 0 speaks \
                 {PROTOCOL_VERSION}; run the same protrain build on every node",
                hello.version
            ))
        } else if hello.world as usize != world {
            Some(format!(
                "rank {} (at {from}) has {WORLD_SIZE}={} but rank 0 has {WORLD_SIZE}={world}; \
                 start every rank with the same world size (the same --nodes and --gpus)",
                hello.rank, hello.world
            ))
        } else if hello.rank == 0 || hello.rank as usize >= world {
            Some(format!(
                "the process at {from} claims rank {} but rank 0 is this process and the \
                 others are 1 to {}; give every process its own {RANK} (node rank x GPUs per \
                 node + local rank)",
                hello.rank,
                world - 1
            ))
        } else if let Some(first) = &peers[hello.rank as usize] {
            let first = first
                .peer_addr()
                .map_or_else(|_| "?".to_string(), |a| a.to_string());
            Some(format!(
                "two processes claim rank {} (at {first} and at {from}); give every process \
                 its own {RANK} (node rank x GPUs per node + local rank)",
                hello.rank
            ))
        } else {
            None
        };
        if let Some(problem) = refusal {
            let told = format!("rank 0 refused this process: {problem}");
            let _ = write_answer(&mut stream, ANSWER_REFUSED, told.as_bytes());
            return Err(stop(&mut peers, problem));
        }
        peers[hello.rank as usize] = Some(stream);
    }
    for (rank, stream) in peers.iter_mut().enumerate() {
        if let Some(stream) = stream {
            write_answer(stream, ANSWER_BLOB, blob).map_err(|e| {
                fail(format!(
                    "rank {rank} hung up before it received the blob ({e}): it died; see its \
                     own output for why"
                ))
            })?;
        }
    }
    Ok(())
}

/// A rank's side: reach rank 0, introduce itself, receive the blob or rank 0's verdict.
fn join(launch: &Launch, timeout: Duration) -> Result<Vec<u8>> {
    let rank = launch.rank;
    let fail = |problem: String| RuntimeError::Rendezvous { rank, problem };
    let master = launch.master();
    let deadline = Instant::now() + timeout;
    let mut last_error = String::from("no attempt finished");
    let mut stream = 'connect: loop {
        match (launch.master_addr.as_str(), launch.master_port).to_socket_addrs() {
            Ok(addrs) => {
                for addr in addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let attempt = Duration::from_secs(1).min(left).max(POLL);
                    match TcpStream::connect_timeout(&addr, attempt) {
                        Ok(stream) => break 'connect stream,
                        Err(e) => last_error = format!("{addr}: {e}"),
                    }
                }
            }
            Err(e) => last_error = format!("cannot resolve `{}`: {e}", launch.master_addr),
        }
        if Instant::now() >= deadline {
            return Err(RuntimeError::RendezvousPort {
                rank,
                problem: PortProblem::Unreachable {
                    master,
                    seconds: timeout.as_secs_f64(),
                    last_error,
                },
            });
        }
        std::thread::sleep(POLL);
    };
    let io = |e: std::io::Error| fail(format!("talking to rank 0 at {master}: {e}"));
    let hello = Hello {
        version: PROTOCOL_VERSION,
        world: launch.world_size as u32,
        rank: rank as u32,
    };
    stream.write_all(&encode_hello(hello)).map_err(io)?;
    stream.flush().map_err(io)?;
    // Rank 0 waits at most `timeout` from its own start, which is before this connection.
    stream
        .set_read_timeout(Some(timeout + ANSWER_GRACE))
        .map_err(io)?;
    let mut head = [0u8; 17];
    if let Err(e) = stream.read_exact(&mut head) {
        let problem = match e.kind() {
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset => format!(
                "rank 0 at {master} closed the connection before handing out the blob: it \
                 failed or was stopped; see its output for why"
            ),
            ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
                "rank 0 at {master} accepted this rank but sent neither the blob nor an error \
                 within {:.1} s; it is stuck or was stopped",
                (timeout + ANSWER_GRACE).as_secs_f64()
            ),
            _ => format!("reading rank 0's answer from {master}: {e}"),
        };
        return Err(fail(problem));
    }
    if head[..8] != MAGIC {
        return Err(RuntimeError::RendezvousPort {
            rank,
            problem: PortProblem::Foreign { master },
        });
    }
    let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
    if version != PROTOCOL_VERSION {
        return Err(fail(format!(
            "rank 0 at {master} speaks rendezvous protocol {version} but this rank speaks \
             {PROTOCOL_VERSION}; run the same protrain build on every node"
        )));
    }
    let status = head[12];
    let len = u32::from_le_bytes([head[13], head[14], head[15], head[16]]) as usize;
    if len > MAX_BLOB {
        return Err(fail(format!(
            "rank 0 at {master} announced {len} bytes, more than the protocol's {MAX_BLOB}; it \
             is not a matching protrain build"
        )));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).map_err(|e| {
        fail(format!(
            "rank 0 at {master} sent {len} bytes' header but not the bytes ({e}); it died"
        ))
    })?;
    match status {
        ANSWER_BLOB => Ok(body),
        ANSWER_REFUSED => Err(fail(String::from_utf8_lossy(&body).into_owned())),
        other => Err(fail(format!(
            "rank 0 at {master} answered with unknown status {other}; run the same protrain \
             build on every node"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(vars: &[(&str, &str)]) -> Result<Option<Launch>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Launch::from_vars(|name| map.get(name).cloned())
    }

    fn error(vars: &[(&str, &str)]) -> String {
        match from(vars) {
            Err(e) => e.to_string(),
            Ok(launch) => panic!("{vars:?} was accepted as {launch:?}"),
        }
    }

    #[test]
    fn no_variables_mean_a_single_process_run() {
        assert_eq!(from(&[]).unwrap(), None);
        assert_eq!(from(&[(MASTER_ADDR, "node0")]).unwrap(), None);
    }

    #[test]
    fn torchrun_variables_are_read() {
        let launch = from(&[
            (RANK, "5"),
            (WORLD_SIZE, "8"),
            (LOCAL_RANK, "1"),
            (MASTER_ADDR, "node0"),
            (MASTER_PORT, "29400"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            launch,
            Launch {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                master_addr: "node0".into(),
                master_port: 29400
            }
        );
        // The launcher hands the same variables to its workers.
        let env = launch.env();
        let back = from(
            &env.iter()
                .map(|(k, v)| (*k, v.as_str()))
                .collect::<Vec<_>>(),
        );
        assert_eq!(back.unwrap().unwrap(), launch);
    }

    #[test]
    fn a_world_of_one_needs_no_master() {
        let launch = from(&[(RANK, "0"), (WORLD_SIZE, "1"), (LOCAL_RANK, "0")])
            .unwrap()
            .unwrap();
        assert_eq!(launch, Launch::single());
    }

    #[test]
    fn bad_variables_are_named_with_the_way_out() {
        let full = [
            (RANK, "1"),
            (WORLD_SIZE, "2"),
            (LOCAL_RANK, "1"),
            (MASTER_ADDR, "node0"),
            (MASTER_PORT, "29500"),
        ];
        let without = |name: &str| -> Vec<(&str, &str)> {
            full.iter().copied().filter(|(k, _)| *k != name).collect()
        };
        let with = |name: &str, value: &'static str| -> Vec<(&str, &str)> {
            full.iter()
                .map(|&(k, v)| if k == name { (k, value) } else { (k, v) })
                .collect()
        };
        let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (without(RANK), "RANK is not set"),
            (without(LOCAL_RANK), "LOCAL_RANK is not set"),
            (without(MASTER_ADDR), "MASTER_ADDR is not set"),
            (without(MASTER_PORT), "MASTER_PORT is not set"),
            (
                with(RANK, "one"),
                "RANK=`one` is not a non-negative integer",
            ),
            (with(RANK, "-1"), "RANK=`-1` is not a non-negative integer"),
            (with(RANK, "2"), "RANK=2 is not below WORLD_SIZE=2"),
            (
                with(LOCAL_RANK, "7"),
                "LOCAL_RANK=7 is not below WORLD_SIZE=2",
            ),
            (with(WORLD_SIZE, "0"), "WORLD_SIZE=0"),
            (
                with(MASTER_PORT, "70000"),
                "MASTER_PORT=`70000` is not a TCP port",
            ),
            (with(MASTER_PORT, "0"), "MASTER_PORT=`0` is not a TCP port"),
        ];
        for (vars, expected) in cases {
            let message = error(&vars);
            assert!(message.contains(expected), "{vars:?}: `{message}`");
            assert!(message.contains("; "), "no way out in `{message}`");
        }
    }

    #[test]
    fn nodes_and_gpus_give_torchrun_ranks() {
        let launch = Launch::for_node(4, 2, 8, 3, "node0:29500").unwrap();
        assert_eq!(
            (launch.rank, launch.world_size, launch.local_rank),
            (19, 32, 3)
        );
        assert_eq!(
            (launch.master_addr.as_str(), launch.master_port),
            ("node0", 29500)
        );
        let v6 = Launch::for_node(1, 0, 2, 1, "[::1]:1234").unwrap();
        assert_eq!((v6.master_addr.as_str(), v6.master_port), ("::1", 1234));
        assert_eq!(v6.master(), "[::1]:1234");
    }

    #[test]
    fn bad_node_options_are_named() {
        let cases: &[(usize, usize, usize, usize, &str, &str)] = &[
            (0, 0, 1, 0, "h:1", "nodes 0"),
            (1, 0, 0, 0, "h:1", "workers_per_node 0"),
            (2, 2, 1, 0, "h:1", "node_rank 2 is not below nodes 2"),
            (
                1,
                0,
                2,
                2,
                "h:1",
                "local rank 2 is not below workers_per_node 2",
            ),
            (1, 0, 1, 0, "node0", "has no port"),
            (1, 0, 1, 0, ":29500", "has no host"),
            (1, 0, 1, 0, "h:http", "port that is not a number"),
            (1, 0, 1, 0, "::1:29500", "IPv6 address without brackets"),
            (1, 0, 1, 0, "[::1:29500", "opens a bracket"),
            (1, 0, 1, 0, "h:0", "has port 0"),
        ];
        for &(nodes, node_rank, gpus, local, master, expected) in cases {
            let message = Launch::for_node(nodes, node_rank, gpus, local, master)
                .unwrap_err()
                .to_string();
            assert!(message.contains(expected), "{expected}: `{message}`");
            assert!(message.contains("pass"), "no way out in `{message}`");
        }
    }

    #[test]
    fn hellos_round_trip_and_strangers_are_not_hellos() {
        let hello = Hello {
            version: PROTOCOL_VERSION,
            world: 4,
            rank: 3,
        };
        assert_eq!(decode_hello(&encode_hello(hello)), Some(hello));
        let mut stranger = encode_hello(hello);
        stranger[0] = b'G';
        assert_eq!(decode_hello(&stranger), None);
    }

    #[test]
    fn rank_lists_read_as_english() {
        assert_eq!(list(&[2]), "2");
        assert_eq!(list(&[1, 3]), "1 and 3");
        assert_eq!(list(&[1, 3, 4]), "1, 3 and 4");
    }
}
