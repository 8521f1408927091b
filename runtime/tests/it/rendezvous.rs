//! The rendezvous between real processes on localhost: the test thread is rank 0 and the test
//! binary re-executes itself (the same test, with `CHILD` set) as the other ranks, which read
//! their place from torchrun's environment variables as a launched worker would. Failures are
//! checked on every side: rank 0's error and each child's.

use protrain_runtime::rendezvous::{share_blob, Launch};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Marks a child process; its value is the rendezvous timeout in milliseconds.
const CHILD: &str = "PROTRAIN_RENDEZVOUS_TEST_CHILD";

/// The blob rank 0 shares: 128 bytes, like an NCCL unique id, none of them equal to its index
/// so a shifted or truncated copy shows.
fn blob() -> Vec<u8> {
    (0..128u32).map(|i| (i * 37 + 11) as u8).collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// In a child: join the rendezvous described by the environment, print the outcome, exit.
/// In the test process: nothing.
fn run_child_if_asked() {
    let Ok(timeout_ms) = std::env::var(CHILD) else {
        return;
    };
    let timeout = Duration::from_millis(timeout_ms.parse().expect("a timeout in ms"));
    let outcome = Launch::from_env()
        .and_then(|launch| {
            let launch = launch.expect("the test sets RANK, WORLD_SIZE and LOCAL_RANK");
            share_blob(&launch, timeout, || panic!("only rank 0 makes the blob"))
        })
        .map(|bytes| hex(&bytes));
    match outcome {
        Ok(hex) => {
            // On a line of its own: the test harness has printed `test NAME ... ` without a newline.
            println!("\nBLOB {hex}");
            std::process::exit(0);
        }
        Err(e) => {
            println!("\nERROR {e}");
            std::process::exit(3);
        }
    }
}

/// A port nothing listens on now: bind to port 0 and let the system choose.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind to port 0");
    listener.local_addr().unwrap().port()
}

/// Starts rank `rank` of `world` as a child running `test`, a test of this module.
fn spawn_rank(test: &str, rank: usize, world: usize, port: u16, timeout: Duration) -> Child {
    // The harness names a test by its path below the crate root (`rendezvous::NAME`).
    let module = module_path!().split_once("::").map_or("", |(_, path)| path);
    let test = format!("{module}::{test}");
    Command::new(std::env::current_exe().expect("the test binary"))
        .args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, timeout.as_millis().to_string())
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("re-execute the test binary")
}

/// A child's outcome: `Ok(hex of the blob)` or `Err(its error)`.
fn outcome(child: Child) -> Result<String, String> {
    let output = child.wait_with_output().expect("wait for a child");
    let stdout = String::from_utf8_lossy(&output.stdout);
    for line in stdout.lines() {
        if let Some(hex) = line.strip_prefix("BLOB ") {
            assert!(output.status.success(), "{stdout}");
            return Ok(hex.to_string());
        }
        if let Some(error) = line.strip_prefix("ERROR ") {
            assert!(!output.status.success(), "{stdout}");
            return Err(error.to_string());
        }
    }
    panic!("a child printed no outcome ({}): {stdout}", output.status)
}

fn rank0(world: usize, port: u16) -> Launch {
    Launch {
        rank: 0,
        world_size: world,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

#[test]
fn every_process_receives_rank_0s_blob() {
    run_child_if_asked();
    let port = free_port();
    let timeout = Duration::from_secs(60);
    // The other ranks start first: they must keep trying until rank 0 listens.
    let children: Vec<Child> = (1..4)
        .map(|r| spawn_rank("every_process_receives_rank_0s_blob", r, 4, port, timeout))
        .collect();
    thread::sleep(Duration::from_millis(300));
    let mine = share_blob(&rank0(4, port), timeout, || Ok(blob())).unwrap();
    assert_eq!(mine, blob());
    for child in children {
        assert_eq!(outcome(child), Ok(hex(&blob())));
    }
}

#[test]
fn a_missing_rank_is_named_on_every_rank_within_the_timeout() {
    run_child_if_asked();
    let port = free_port();
    // Long enough for the child to start on a busy machine: rank 1 must have joined.
    let timeout = Duration::from_secs(5);
    // Rank 2 of 3 never comes.
    let child = spawn_rank(
        "a_missing_rank_is_named_on_every_rank_within_the_timeout",
        1,
        3,
        port,
        timeout,
    );
    let start = Instant::now();
    let error = share_blob(&rank0(3, port), timeout, || Ok(blob()))
        .unwrap_err()
        .to_string();
    assert!(start.elapsed() < timeout + Duration::from_secs(2));
    assert!(error.contains("rank(s) 2 of 3 did not join"), "{error}");
    let theirs = outcome(child).unwrap_err();
    assert!(theirs.starts_with("rank 1: "), "{theirs}");
    assert!(theirs.contains("rank(s) 2 of 3 did not join"), "{theirs}");
}

#[test]
fn a_wrong_world_size_is_refused_naming_both_sides() {
    run_child_if_asked();
    let port = free_port();
    let timeout = Duration::from_secs(30);
    let child = spawn_rank(
        "a_wrong_world_size_is_refused_naming_both_sides",
        1,
        3,
        port,
        timeout,
    );
    let error = share_blob(&rank0(2, port), timeout, || Ok(blob()))
        .unwrap_err()
        .to_string();
    let both = "has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2";
    assert!(error.contains(both), "{error}");
    let theirs = outcome(child).unwrap_err();
    assert!(theirs.contains(both), "{theirs}");
    assert!(theirs.contains("same world size"), "{theirs}");
}

#[test]
fn a_duplicate_rank_is_refused() {
    run_child_if_asked();
    let port = free_port();
    let timeout = Duration::from_secs(30);
    let name = "a_duplicate_rank_is_refused";
    let first = spawn_rank(name, 1, 3, port, timeout);
    let second = spawn_rank(name, 1, 3, port, timeout);
    let error = share_blob(&rank0(3, port), timeout, || Ok(blob()))
        .unwrap_err()
        .to_string();
    assert!(error.contains("two processes claim rank 1"), "{error}");
    for child in [first, second] {
        let theirs = outcome(child).unwrap_err();
        assert!(theirs.contains("two processes claim rank 1"), "{theirs}");
    }
}

/// A connection that introduces itself as rank 2 and then closes: a rank that died after it
/// joined.
fn join_and_die(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut stream = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("rank 0 never listened: {e}"),
        }
    };
    let mut hello = b"PTRDZV\r\n".to_vec();
    for word in [1u32, 3, 2] {
        hello.extend_from_slice(&word.to_le_bytes());
    }
    stream.write_all(&hello).unwrap();
}

#[test]
fn a_rank_that_joins_and_dies_is_reported_missing() {
    let port = free_port();
    let timeout = Duration::from_secs(3);
    let server = thread::spawn(move || share_blob(&rank0(3, port), timeout, || Ok(blob())));
    join_and_die(port);
    let mut rank1 = rank0(3, port);
    rank1.rank = 1;
    rank1.local_rank = 1;
    let theirs = share_blob(&rank1, timeout, || unreachable!())
        .unwrap_err()
        .to_string();
    let error = server.join().unwrap().unwrap_err().to_string();
    assert!(error.contains("rank(s) 2 of 3"), "{error}");
    assert!(theirs.contains("rank(s) 2 of 3"), "{theirs}");
}

#[test]
fn a_stray_connection_does_not_stop_the_rendezvous() {
    let port = free_port();
    let timeout = Duration::from_secs(30);
    let server = thread::spawn(move || share_blob(&rank0(2, port), timeout, || Ok(blob())));
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut stray = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("rank 0 never listened: {e}"),
        }
    };
    stray
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut rank1 = rank0(2, port);
    rank1.rank = 1;
    rank1.local_rank = 1;
    assert_eq!(
        share_blob(&rank1, timeout, || unreachable!()).unwrap(),
        blob()
    );
    assert_eq!(server.join().unwrap().unwrap(), blob());
    // The stray got nothing but a closed connection.
    // (a reset, when rank 0 closed it with the stray's request unread).
    let mut rest = Vec::new();
    match stray.read_to_end(&mut rest) {
        Ok(_) => assert!(rest.is_empty(), "the stray was answered: {rest:?}"),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
}

#[test]
fn a_rank_0_that_dies_is_reported() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // A rank 0 that accepts, hears the hello and dies before answering.
    let server = thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut hello = [0u8; 20];
        stream.read_exact(&mut hello).unwrap();
    });
    let mut rank1 = rank0(2, port);
    rank1.rank = 1;
    let error = share_blob(&rank1, Duration::from_secs(30), || unreachable!())
        .unwrap_err()
        .to_string();
    server.join().unwrap();
    assert!(
        error.contains("closed the connection before handing out"),
        "{error}"
    );
}

#[test]
fn an_absent_rank_0_is_reported_within_the_timeout() {
    let mut rank1 = rank0(2, free_port());
    rank1.rank = 1;
    let start = Instant::now();
    let error = share_blob(&rank1, Duration::from_millis(400), || unreachable!())
        .unwrap_err()
        .to_string();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(error.contains("rank 1: "), "{error}");
    assert!(
        error.contains("could not reach rank 0 at 127.0.0.1:"),
        "{error}"
    );
}

#[test]
fn a_world_of_one_exchanges_nothing() {
    // Port 1 is never opened: a world of one must not listen.
    let mut single = Launch::single();
    single.master_port = 1;
    let mine = share_blob(&single, Duration::from_millis(1), || Ok(blob())).unwrap();
    assert_eq!(mine, blob());
}
