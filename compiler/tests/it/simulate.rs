//! Simulator tests: hand-built schedules with a stub cost model, exact span times, deadlocks,
//! the Chrome trace, and instruction costs from the roofline.

// One module, so that `cargo test -p protrain-compiler simulate` selects these tests by name.
mod simulate {
    use protrain_compiler::cost::{AdamShares, CopyDir, CostModel, Roofline};
    use protrain_compiler::simulate::{
        category, chrome_trace, device_adamw_runs, instr_label, instr_seconds, simulate_unverified,
        stream_seconds, SimulateError, Simulation, StuckStream,
    };
    use protrain_ir::{
        BlockKind, Buffer, BufferId, BufferKind, ChunkId, ChunkTable, CopyKind, DType, EventId,
        Graph, GraphInfo, HardwareProfile, Header, Instr, OpId, OpKind, Phase, Policy, Prediction,
        Role, Schedule, Space, Stream, StreamId, StreamKind, TensorRef, TensorType, WeightLayout,
        FORMAT_VERSION,
    };
    use serde_json::Value as Json;

    const MIB: u64 = 1 << 20;

    // The ops of `tiny_graph`, in order.
    const EMBEDDING: OpId = OpId(0);
    const LINEAR: OpId = OpId(1);
    const LOSS: OpId = OpId(2);
    const ADAMW: OpId = OpId(3);

    // The buffers of `schedule`.
    const DEVICE: BufferId = BufferId(0);
    const HOST: BufferId = BufferId(1);

    /// Fixed times: embedding 1 s, linear 2 s, cross-entropy 0.5 s, anything else 0.25 s;
    /// 1 s per MiB host to device, 0.5 s per MiB device to host, 0.1 s per MiB on the device;
    /// a CPU Adam step 1 s per 32 parameters, a device one 1 s per 128.
    struct Stub;

    impl CostModel for Stub {
        fn op_seconds(
            &self,
            kind: &OpKind,
            _inputs: &[&TensorType],
            _outputs: &[&TensorType],
            _dtype: DType,
        ) -> f64 {
            match kind {
                OpKind::Embedding { .. } => 1.0,
                OpKind::Linear { .. } => 2.0,
                OpKind::CrossEntropy => 0.5,
                _ => 0.25,
            }
        }

        fn copy_seconds(&self, bytes: u64, dir: CopyDir) -> f64 {
            let per_mib = match dir {
                CopyDir::HostToDevice => 1.0,
                CopyDir::DeviceToHost => 0.5,
                CopyDir::DeviceToDevice => 0.1,
                CopyDir::DiskToHost => 2.0,
                CopyDir::HostToDisk => 3.0,
            };
            bytes as f64 / MIB as f64 * per_mib
        }

        fn cpu_adam_seconds(&self, params: u64) -> f64 {
            params as f64 / 32.0
        }

        fn gpu_adam_seconds(&self, params: u64) -> f64 {
            params as f64 / 128.0
        }
    }

    /// `tokens -> embedding -> linear (lm_head) -> cross_entropy`, and an AdamW on the head's
    /// weight (128 parameters), all f32.
    fn tiny_graph() -> Graph {
        let mut g = Graph::new(GraphInfo {
            model: "tiny".into(),
            batch: 2,
            seq: 4,
        });
        let emb = g.add_block("transformer.wte", BlockKind::Embedding);
        let head = g.add_block("lm_head", BlockKind::Head);
        let tokens = g.add_input("tokens", TensorType::new([2, 4], DType::I32));
        let targets = g.add_input("targets", TensorType::new([2, 4], DType::I32));
        let wte = g.add_param("transformer.wte.weight", [16, 8], DType::F32, emb);
        let w = g.add_param("lm_head.weight", [8, 16], DType::F32, head);
        let (wte, w) = (g.param(wte).value, g.param(w).value);
        let embedding = OpKind::Embedding { padding_idx: None };
        let x = g
            .add_op(
                embedding,
                &[tokens, wte],
                "h",
                Role::Activation,
                emb,
                Phase::Forward,
            )
            .unwrap();
        let linear = OpKind::Linear {
            bias: false,
            layout: WeightLayout::InOut,
        };
        let logits = g
            .add_op(
                linear,
                &[x, w],
                "logits",
                Role::Activation,
                head,
                Phase::Forward,
            )
            .unwrap();
        let loss = g
            .add_op(
                OpKind::CrossEntropy,
                &[logits, targets],
                "loss",
                Role::Loss,
                head,
                Phase::Forward,
            )
            .unwrap();
        g.add_output(loss);
        let ty = TensorType::new([8, 16], DType::F32);
        let grad = g.add_state("lm_head.weight.grad", ty.clone());
        let m = g.add_state("lm_head.weight.m", ty.clone());
        let v = g.add_state("lm_head.weight.v", ty);
        let adamw = OpKind::AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            clipped: false,
        };
        g.add_op_multi(adamw, &[w, grad, m, v], &[], head, Phase::Optimizer)
            .unwrap();
        g
    }

    fn at(buffer: BufferId) -> TensorRef {
        TensorRef { buffer, offset: 0 }
    }

    /// A schedule around `graph` with a device buffer, a host buffer, `events` events and the
    /// given streams. Kernels address nothing: the simulator reads only their ops.
    fn schedule(
        graph: Graph,
        events: u32,
        streams: Vec<(&str, StreamKind, Vec<Instr>)>,
    ) -> Schedule {
        let buffer = |name: &str, space| Buffer {
            name: name.into(),
            space,
            offset: 0,
            size: 64 * MIB,
            kind: BufferKind::Workspace,
            pitch: None,
        };
        Schedule {
            header: Header {
                format_version: FORMAT_VERSION,
                model: "tiny".into(),
                batch: 2,
                seq: 4,
                dtype: DType::F32,
                param_count: graph.param_count(),
                hardware: "stub".into(),
                device_budget_bytes: 64 * MIB,
                host_budget_bytes: 64 * MIB,
                disk_budget_bytes: 0,
                policy: Policy::resident(1, 0),
                prediction: Prediction::default(),
                report: String::new(),
            },
            graph,
            chunks: ChunkTable {
                chunk_bytes: 0,
                chunks: Vec::new(),
                world_size: 1,
                param_chunk: Vec::new(),
                trials: Vec::new(),
            },
            buffers: vec![buffer("device", Space::Device), buffer("host", Space::Host)],
            streams: streams
                .into_iter()
                .map(|(name, kind, instrs)| Stream {
                    name: name.into(),
                    kind,
                    instrs,
                })
                .collect(),
            events,
            arena_bytes: 64 * MIB,
            host_bytes: 64 * MIB,
            disk_bytes: 0,
            homes: Vec::new(),
            masters: Vec::new(),
            loss: at(DEVICE),
            micro_batch_losses: Vec::new(),
        }
    }

    fn kernel(op: OpId) -> Instr {
        Instr::Kernel {
            op,
            inputs: Vec::new(),
            outputs: Vec::new(),
            workspace: None,
        }
    }

    fn fetch(chunk: u32, mib: u64) -> Instr {
        Instr::Copy {
            what: CopyKind::FetchChunk {
                chunk: ChunkId(chunk),
            },
            src: at(HOST),
            dst: at(DEVICE),
            bytes: mib * MIB,
        }
    }

    fn offload(chunk: u32, mib: u64) -> Instr {
        Instr::Copy {
            what: CopyKind::OffloadGrads {
                chunk: ChunkId(chunk),
            },
            src: at(DEVICE),
            dst: at(HOST),
            bytes: mib * MIB,
        }
    }

    fn record(e: u32) -> Instr {
        Instr::Record { event: EventId(e) }
    }

    fn wait(e: u32) -> Instr {
        Instr::Wait { event: EventId(e) }
    }

    /// Simulates `schedule` with the stub and compares every span, as
    /// `(stream, index, start, end, category)`, and the step time. Stub times are exact in
    /// binary, so the comparison is exact.
    fn check(
        schedule: &Schedule,
        expect_spans: &[(u32, usize, f64, f64, &str)],
        expect_step: f64,
    ) -> Simulation {
        let sim = simulate_unverified(schedule, &Stub).unwrap();
        let spans: Vec<(u32, usize, f64, f64, &str)> = sim
            .timeline
            .iter()
            .map(|s| (s.stream.0, s.index, s.start, s.end, s.category))
            .collect();
        assert_eq!(spans, expect_spans);
        assert_eq!(sim.step_seconds, expect_step);
        sim
    }

    /// Compute: embedding, wait for the fetch, linear, loss. H2D: fetch 3 MiB (3 s), record.
    fn fetch_then_compute(fetch_mib: u64) -> Schedule {
        schedule(
            tiny_graph(),
            1,
            vec![
                (
                    "compute",
                    StreamKind::Compute,
                    vec![kernel(EMBEDDING), wait(0), kernel(LINEAR), kernel(LOSS)],
                ),
                (
                    "h2d",
                    StreamKind::HostToDevice,
                    vec![fetch(0, fetch_mib), record(0)],
                ),
            ],
        )
    }

    #[test]
    fn simulate_wait_delays_compute_until_the_copy_ends() {
        let sim = check(
            &fetch_then_compute(3),
            &[
                (0, 0, 0.0, 1.0, category::COMPUTE),
                (1, 0, 0.0, 3.0, category::H2D),
                // The compute stream stalls from the end of the embedding to the record.
                (0, 1, 1.0, 3.0, category::WAIT),
                (0, 2, 3.0, 5.0, category::COMPUTE),
                (0, 3, 5.0, 5.5, category::COMPUTE),
            ],
            5.5,
        );
        assert_eq!(sim.stream_busy_seconds, [3.5, 3.0]);
        assert_eq!(sim.phase_seconds.forward, 3.5);
        assert_eq!(sim.phase_seconds.total(), 3.5);
        // The copy overlaps the embedding for 1 s; the other 2 s are exposed.
        assert_eq!(sim.exposed_communication_seconds(), 2.0);
    }

    #[test]
    fn simulate_copy_overlaps_independent_compute() {
        // A 1 MiB fetch ends (1 s) exactly when the embedding does: no stall, no wait span.
        let sim = check(
            &fetch_then_compute(1),
            &[
                (0, 0, 0.0, 1.0, category::COMPUTE),
                (1, 0, 0.0, 1.0, category::H2D),
                (0, 2, 1.0, 3.0, category::COMPUTE),
                (0, 3, 3.0, 3.5, category::COMPUTE),
            ],
            3.5,
        );
        assert_eq!(sim.stream_busy_seconds, [3.5, 1.0]);
        assert_eq!(sim.exposed_communication_seconds(), 0.0);
    }

    #[test]
    fn simulate_offload_then_cpu_adam_after_the_backward_pass() {
        // Compute runs the forward pass and records; D2H offloads 4 MiB of gradients (2 s);
        // the host optimizer waits for them and runs a CPU Adam over 128 parameters (4 s).
        let s = schedule(
            tiny_graph(),
            2,
            vec![
                (
                    "compute",
                    StreamKind::Compute,
                    vec![kernel(EMBEDDING), kernel(LINEAR), kernel(LOSS), record(0)],
                ),
                (
                    "d2h",
                    StreamKind::DeviceToHost,
                    vec![wait(0), offload(1, 4), record(1)],
                ),
                (
                    "host adam",
                    StreamKind::HostOptimizer,
                    vec![wait(1), kernel(ADAMW)],
                ),
            ],
        );
        let sim = check(
            &s,
            &[
                (0, 0, 0.0, 1.0, category::COMPUTE),
                (1, 0, 0.0, 3.5, category::WAIT),
                (2, 0, 0.0, 5.5, category::WAIT),
                (0, 1, 1.0, 3.0, category::COMPUTE),
                (0, 2, 3.0, 3.5, category::COMPUTE),
                (1, 1, 3.5, 5.5, category::D2H),
                (2, 1, 5.5, 9.5, category::CPU_ADAM),
            ],
            9.5,
        );
        assert_eq!(sim.stream_busy_seconds, [3.5, 2.0, 4.0]);
        // The CPU Adam is not a compute-stream phase.
        assert_eq!(sim.phase_seconds.optimizer, 0.0);
        assert_eq!(sim.exposed_communication_seconds(), 2.0);
        let labels: Vec<&str> = sim.timeline.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "embedding h",
                "wait event0",
                "wait event1",
                "linear logits",
                "cross_entropy loss",
                "offload grads chunk 1 (4.0 MiB)",
                "adamw lm_head.weight",
            ]
        );
    }

    /// [`Stub`]'s prices on the host backend, whose streams share 2 CPU cores.
    struct HostStub;

    impl CostModel for HostStub {
        fn op_seconds(&self, k: &OpKind, i: &[&TensorType], o: &[&TensorType], d: DType) -> f64 {
            Stub.op_seconds(k, i, o, d)
        }

        fn copy_seconds(&self, bytes: u64, dir: CopyDir) -> f64 {
            Stub.copy_seconds(bytes, dir)
        }

        fn cpu_adam_seconds(&self, params: u64) -> f64 {
            Stub.cpu_adam_seconds(params)
        }

        fn gpu_adam_seconds(&self, params: u64) -> f64 {
            Stub.gpu_adam_seconds(params)
        }

        fn host_cores(&self) -> Option<f64> {
            Some(2.0)
        }
    }

    /// The forward pass on the compute stream and one AdamW on the host optimizer stream,
    /// both from the step's start.
    fn host_adam_beside_the_forward_pass() -> Schedule {
        schedule(
            tiny_graph(),
            0,
            vec![
                (
                    "compute",
                    StreamKind::Compute,
                    vec![kernel(EMBEDDING), kernel(LINEAR), kernel(LOSS)],
                ),
                ("host adam", StreamKind::HostOptimizer, vec![kernel(ADAMW)]),
            ],
        )
    }

    /// The CPU Adam (4 s over 128 parameters) runs from the start beside the forward pass
    /// (3.5 s of compute). On the host the two share the cores half and half while both run:
    /// the compute kernels lose the 3.5 s of Adam work beside them (the step's shared term),
    /// and the host optimizer stream is busy 3.5 s longer than its Adam work. On a device the
    /// CPU Adam shares nothing with the compute kernels: 4 s busy, a 4 s step.
    #[test]
    fn simulate_host_adam_beside_host_compute_runs_at_a_share_of_the_cores() {
        let s = host_adam_beside_the_forward_pass();
        let host = simulate_unverified(&s, &HostStub).unwrap();
        assert_eq!(host.stream_busy_seconds, [3.5, 7.5]);
        assert_eq!(host.step_seconds, 4.0 + 3.5);
        let device = simulate_unverified(&s, &Stub).unwrap();
        assert_eq!(device.stream_busy_seconds, [3.5, 4.0]);
        assert_eq!(device.step_seconds, 4.0);
        // After the backward pass (the Adam waits for the last kernel) nothing is shared.
        let after = schedule(
            tiny_graph(),
            1,
            vec![
                (
                    "compute",
                    StreamKind::Compute,
                    vec![kernel(EMBEDDING), kernel(LINEAR), kernel(LOSS), record(0)],
                ),
                (
                    "host adam",
                    StreamKind::HostOptimizer,
                    vec![wait(0), kernel(ADAMW)],
                ),
            ],
        );
        let host = simulate_unverified(&after, &HostStub).unwrap();
        assert_eq!(host.stream_busy_seconds, [3.5, 4.0]);
        assert_eq!(host.step_seconds, 7.5);
    }

    #[test]
    fn simulate_device_adamw_counts_as_optimizer_phase() {
        let s = schedule(
            tiny_graph(),
            0,
            vec![(
                "compute",
                StreamKind::Compute,
                vec![kernel(EMBEDDING), kernel(ADAMW)],
            )],
        );
        let sim = check(
            &s,
            &[
                (0, 0, 0.0, 1.0, category::COMPUTE),
                (0, 1, 1.0, 2.0, category::COMPUTE),
            ],
            2.0,
        );
        assert_eq!(sim.phase_seconds.forward, 1.0);
        assert_eq!(sim.phase_seconds.get(Phase::Optimizer), 1.0);
    }

    #[test]
    fn simulate_empty_schedule_takes_no_time() {
        let sim = check(&schedule(tiny_graph(), 0, Vec::new()), &[], 0.0);
        assert!(sim.stream_busy_seconds.is_empty());
    }

    #[test]
    fn simulate_long_pipeline_is_compute_bound() {
        // 50k fetches of 0.5 s each, every one awaited by a 1 s kernel: after the first fetch
        // the compute stream never stalls. 100k kernels and copies plus their events.
        let n = 50_000u32;
        let mut compute = Vec::new();
        let mut h2d = Vec::new();
        for i in 0..n {
            h2d.push(Instr::Copy {
                what: CopyKind::FetchChunk { chunk: ChunkId(i) },
                src: at(HOST),
                dst: at(DEVICE),
                bytes: MIB / 2,
            });
            h2d.push(record(i));
            compute.push(wait(i));
            compute.push(kernel(EMBEDDING));
        }
        let s = schedule(
            tiny_graph(),
            n,
            vec![
                ("compute", StreamKind::Compute, compute),
                ("h2d", StreamKind::HostToDevice, h2d),
            ],
        );
        let sim = simulate_unverified(&s, &Stub).unwrap();
        assert_eq!(sim.step_seconds, f64::from(n) + 0.5);
        assert_eq!(sim.stream_busy_seconds, [f64::from(n), f64::from(n) / 2.0]);
        // One stall (the first fetch), then every kernel and copy.
        assert_eq!(sim.timeline.len(), 2 * n as usize + 1);
        assert_eq!(sim.exposed_communication_seconds(), 0.5);
    }

    /// Simulates `schedule` and expects it to deadlock with exactly `expect` stuck.
    fn check_deadlock(schedule: &Schedule, expect: &[StuckStream], why: &[&str]) {
        let err = simulate_unverified(schedule, &Stub).unwrap_err();
        let text = err.to_string();
        match err {
            SimulateError::Deadlock { stuck } => assert_eq!(stuck, expect),
            other => panic!("expected a deadlock, got {other:?}"),
        }
        for w in why {
            assert!(text.contains(w), "expected {w:?} in {text:?}");
        }
    }

    fn stuck(
        stream: u32,
        name: &str,
        index: usize,
        event: u32,
        recorded_at: Option<(u32, usize)>,
    ) -> StuckStream {
        StuckStream {
            stream: StreamId(stream),
            name: name.into(),
            index,
            event: EventId(event),
            recorded_at: recorded_at.map(|(s, i)| (StreamId(s), i)),
        }
    }

    #[test]
    fn simulate_reports_a_wait_before_its_record() {
        let s = schedule(
            tiny_graph(),
            1,
            vec![(
                "compute",
                StreamKind::Compute,
                vec![kernel(EMBEDDING), wait(0), record(0)],
            )],
        );
        check_deadlock(
            &s,
            &[stuck(0, "compute", 1, 0, Some((0, 2)))],
            &[
                "deadlocks",
                "stream0 (compute) waits at instruction 1 for event0",
                "which stream0 records at instruction 2, never reached",
            ],
        );
    }

    #[test]
    fn simulate_reports_a_never_recorded_event() {
        // The compute stream finishes; the H2D stream waits forever.
        let s = schedule(
            tiny_graph(),
            2,
            vec![
                ("compute", StreamKind::Compute, vec![kernel(EMBEDDING)]),
                ("h2d", StreamKind::HostToDevice, vec![wait(1), fetch(0, 1)]),
            ],
        );
        check_deadlock(
            &s,
            &[stuck(1, "h2d", 0, 1, None)],
            &["stream1 (h2d) waits at instruction 0 for event1, which no stream records"],
        );
    }

    #[test]
    fn simulate_reports_a_cycle_of_waits() {
        let s = schedule(
            tiny_graph(),
            2,
            vec![
                (
                    "compute",
                    StreamKind::Compute,
                    vec![kernel(EMBEDDING), wait(0), record(1)],
                ),
                ("h2d", StreamKind::HostToDevice, vec![wait(1), record(0)]),
            ],
        );
        check_deadlock(
            &s,
            &[
                stuck(0, "compute", 1, 0, Some((1, 1))),
                stuck(1, "h2d", 0, 1, Some((0, 2))),
            ],
            &["compute", "h2d"],
        );
    }

    /// Simulating `schedule` fails with an error whose text contains `why`.
    fn check_rejects(schedule: &Schedule, why: &str) {
        let err = simulate_unverified(schedule, &Stub).unwrap_err();
        assert!(err.to_string().contains(why), "expected {why:?} in {err}");
    }

    #[test]
    fn simulate_rejects_bad_schedules_without_panicking() {
        let one = |instrs| {
            schedule(
                tiny_graph(),
                1,
                vec![("compute", StreamKind::Compute, instrs)],
            )
        };
        check_rejects(
            &one(vec![record(0), record(0)]),
            "event0 is recorded twice, by stream0 at instruction 0 and by stream0 at instruction 1",
        );
        check_rejects(
            &one(vec![kernel(OpId(99))]),
            "stream0 instruction 0 refers to op99",
        );
        check_rejects(
            &one(vec![kernel(EMBEDDING), wait(7)]),
            "refers to event7 (the schedule declares 1 events)",
        );
        let copy = Instr::Copy {
            what: CopyKind::FetchChunk { chunk: ChunkId(0) },
            src: at(BufferId(5)),
            dst: at(DEVICE),
            bytes: 1,
        };
        check_rejects(&one(vec![copy.clone()]), "refers to buf5");
        // instr_seconds and instr_label are total as well.
        let s = one(Vec::new());
        assert_eq!(instr_seconds(&s, StreamId(0), &copy, &Stub), 0.0);
        assert_eq!(
            instr_seconds(&s, StreamId(9), &kernel(OpId(99)), &Stub),
            0.0
        );
        assert_eq!(instr_label(&s, &kernel(OpId(99))), "op99");
    }

    #[test]
    fn simulate_chrome_trace_is_valid_json_with_one_event_per_timed_instruction() {
        let s = fetch_then_compute(3);
        let sim = simulate_unverified(&s, &Stub).unwrap();
        let trace: Json = serde_json::from_str(&sim.chrome_trace(&s)).unwrap();
        assert_eq!(trace["displayTimeUnit"], "ms");
        let events = trace["traceEvents"].as_array().unwrap();
        let complete: Vec<&Json> = events.iter().filter(|e| e["ph"] == "X").collect();
        // Embedding, the stall, linear, loss, the fetch; the record takes no time.
        assert_eq!(complete.len(), 5);
        let names: Vec<(&str, &str, u64, f64, f64)> = complete
            .iter()
            .map(|e| {
                (
                    e["name"].as_str().unwrap(),
                    e["cat"].as_str().unwrap(),
                    e["tid"].as_u64().unwrap(),
                    e["ts"].as_f64().unwrap(),
                    e["dur"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            names,
            [
                ("embedding h", "compute", 0, 0.0, 1e6),
                ("fetch chunk 0 (3.0 MiB)", "h2d", 1, 0.0, 3e6),
                ("wait event0", "wait", 0, 1e6, 2e6),
                ("linear logits", "compute", 0, 3e6, 2e6),
                ("cross_entropy loss", "compute", 0, 5e6, 0.5e6),
            ]
        );
        for e in &complete {
            assert_eq!(e["pid"], 1);
        }
        assert_eq!(complete[3]["args"]["phase"], "forward");
        assert_eq!(complete[3]["args"]["block"], "lm_head");
        assert_eq!(complete[1]["args"]["bytes"], 3 * MIB);
        let threads: Vec<(u64, &str)> = events
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
            .map(|e| {
                (
                    e["tid"].as_u64().unwrap(),
                    e["args"]["name"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(threads, [(0, "compute"), (1, "h2d")]);
    }

    #[test]
    fn simulate_chrome_trace_takes_measured_spans() {
        use protrain_compiler::simulate::Span;
        let s = fetch_then_compute(3);
        // A span for an instruction the schedule lacks, and a zero-length one that is dropped.
        let spans = [
            Span {
                stream: StreamId(3),
                index: 42,
                start: 0.5,
                end: 0.75,
                label: "measured".into(),
                category: category::COMPUTE,
            },
            Span {
                stream: StreamId(0),
                index: 0,
                start: 1.0,
                end: 1.0,
                label: "empty".into(),
                category: category::COMPUTE,
            },
        ];
        let trace: Json = serde_json::from_str(&chrome_trace(&s, &spans)).unwrap();
        let complete: Vec<&Json> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X")
            .collect();
        assert_eq!(complete.len(), 1);
        assert_eq!(complete[0]["name"], "measured");
        assert_eq!(complete[0]["tid"], 3);
        assert_eq!(complete[0]["args"]["index"], 42);
    }

    /// The counter events named `name` as `(ts, args)`.
    fn counters<'a>(events: &'a [Json], name: &str) -> Vec<(f64, &'a Json)> {
        events
            .iter()
            .filter(|e| e["ph"] == "C" && e["name"] == name)
            .map(|e| (e["ts"].as_f64().unwrap(), &e["args"]))
            .collect()
    }

    #[test]
    fn simulate_chrome_trace_has_memory_counters_by_kind() {
        // The fetch's slot and the host chunk hold state all step; a 1 MiB activation lives
        // from its writer (the embedding, 0-1 s) to its last reader (the linear, 3-5 s).
        let mut s = fetch_then_compute(3);
        s.buffers[DEVICE.index()].kind = BufferKind::ChunkSlot { slot: 0 };
        s.buffers[HOST.index()].kind = BufferKind::HostChunk { chunk: ChunkId(0) };
        s.buffers.push(Buffer {
            name: "h".into(),
            space: Space::Device,
            offset: 64 * MIB,
            size: MIB,
            kind: BufferKind::Activation,
            pitch: None,
        });
        let act = at(BufferId(2));
        s.streams[0].instrs[0] = Instr::Kernel {
            op: EMBEDDING,
            inputs: Vec::new(),
            outputs: vec![act],
            workspace: None,
        };
        s.streams[0].instrs[2] = Instr::Kernel {
            op: LINEAR,
            inputs: vec![act],
            outputs: Vec::new(),
            workspace: None,
        };
        let sim = simulate_unverified(&s, &Stub).unwrap();
        let trace: Json = serde_json::from_str(&sim.chrome_trace(&s)).unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        for e in events.iter().filter(|e| e["ph"] == "C") {
            assert_eq!(e["pid"], 1);
        }
        let device: Vec<(f64, Json)> = counters(events, "device memory")
            .into_iter()
            .map(|(t, a)| (t, a.clone()))
            .collect();
        let slot = 64 * MIB;
        assert_eq!(
            device,
            [
                (
                    0.0,
                    serde_json::json!({"chunk buffers": slot, "temporaries": MIB})
                ),
                (
                    5e6,
                    serde_json::json!({"chunk buffers": slot, "temporaries": 0})
                ),
                (
                    5.5e6,
                    serde_json::json!({"chunk buffers": 0, "temporaries": 0})
                ),
            ]
        );
        let in_use = |name| -> Vec<(f64, u64)> {
            counters(events, name)
                .into_iter()
                .map(|(t, a)| (t, a["bytes"].as_u64().unwrap()))
                .collect()
        };
        assert_eq!(
            in_use("device memory in use"),
            [(0.0, slot + MIB), (5e6, slot), (5.5e6, 0)]
        );
        assert_eq!(in_use("host memory in use"), [(0.0, 64 * MIB), (5.5e6, 0)]);
        assert_eq!(
            counters(events, "host memory")[0].1,
            &serde_json::json!({"parameters": 64 * MIB})
        );
    }

    /// A schedule whose graph is one big bf16 linear, `x [8,1024,4096] @ w [4096,4096]`, in a
    /// header that says f32: the kernel must be costed in the op's own element type.
    fn big_linear() -> Schedule {
        let mut g = Graph::new(GraphInfo {
            model: "big".into(),
            batch: 8,
            seq: 1024,
        });
        let head = g.add_block("lm_head", BlockKind::Head);
        let x = g.add_input("x", TensorType::new([8, 1024, 4096], DType::BF16));
        let w = g.add_param("w", [4096, 4096], DType::BF16, head);
        let w = g.param(w).value;
        let linear = OpKind::Linear {
            bias: false,
            layout: WeightLayout::InOut,
        };
        g.add_op(linear, &[x, w], "y", Role::Activation, head, Phase::Forward)
            .unwrap();
        schedule(g, 0, vec![("compute", StreamKind::Compute, Vec::new())])
    }

    #[test]
    fn simulate_instr_seconds_with_the_roofline() {
        let p = HardwareProfile::preset("a100-80gb").unwrap();
        let roofline = Roofline::new(p.clone());
        let s = big_linear();
        let seconds = instr_seconds(&s, StreamId(0), &kernel(OpId(0)), &roofline);
        let flops = 2.0 * 8.0 * 1024.0 * 4096.0 * 4096.0;
        let expected = flops / (p.peak(DType::BF16) * 0.7) + p.launch_overhead_s;
        assert!(
            (seconds - expected).abs() <= 1e-12 * expected,
            "{seconds:e} vs {expected:e}"
        );
        // Compute-bound: the memory term is well below it.
        let bytes = 2.0 * (2.0 * 8.0 * 1024.0 * 4096.0 + 4096.0 * 4096.0);
        assert!(bytes / p.device_bandwidth < seconds / 2.0);

        let copy = fetch(0, 64);
        let expected = (64 * MIB) as f64 / p.h2d_bandwidth + p.launch_overhead_s;
        let seconds = instr_seconds(&s, StreamId(0), &copy, &roofline);
        assert!((seconds - expected).abs() <= 1e-12 * expected);
        let expected = (64 * MIB) as f64 / p.d2h_bandwidth + p.launch_overhead_s;
        let seconds = instr_seconds(&s, StreamId(0), &offload(0, 64), &roofline);
        assert!((seconds - expected).abs() <= 1e-12 * expected);
        assert_eq!(instr_seconds(&s, StreamId(0), &record(0), &roofline), 0.0);
    }

    #[test]
    fn simulate_instr_seconds_prices_adamw_by_stream() {
        let p = HardwareProfile::preset("a100-80gb").unwrap();
        let roofline = Roofline::new(p.clone());
        let s = schedule(
            tiny_graph(),
            0,
            vec![
                ("compute", StreamKind::Compute, Vec::new()),
                ("host adam", StreamKind::HostOptimizer, Vec::new()),
            ],
        );
        let adamw = kernel(ADAMW);
        assert_eq!(
            instr_seconds(&s, StreamId(1), &adamw, &roofline),
            roofline.cpu_adam_seconds(128)
        );
        assert_eq!(
            instr_seconds(&s, StreamId(0), &adamw, &roofline),
            roofline.gpu_adam_seconds(128)
        );
        // The stub tells the two apart exactly: 128/32 on the host, 128/128 on the device.
        assert_eq!(instr_seconds(&s, StreamId(1), &adamw, &Stub), 4.0);
        assert_eq!(instr_seconds(&s, StreamId(0), &adamw, &Stub), 1.0);
    }

    /// A host profile's measured per-op CPU Adam cost (`cpu_adam_op_s`) is paid by every AdamW
    /// op of the host optimizer stream, on top of its parameters at the rate: two ops of 128
    /// parameters are busy twice that longer than without it; a device AdamW does not pay it,
    /// and a profile without the figure prices the rate alone.
    #[test]
    fn simulate_host_adamw_ops_each_pay_the_profiles_per_op_cost() {
        let mut p = HardwareProfile::host();
        let plain = Roofline::new(p.clone());
        p.cpu_adam_op_s = 2.5e-3;
        let measured = Roofline::new(p.clone());
        let s = schedule(
            tiny_graph(),
            0,
            vec![
                ("compute", StreamKind::Compute, Vec::new()),
                (
                    "host adam",
                    StreamKind::HostOptimizer,
                    vec![kernel(ADAMW), kernel(ADAMW)],
                ),
            ],
        );
        let adamw = kernel(ADAMW);
        assert_eq!(
            instr_seconds(&s, StreamId(1), &adamw, &measured),
            plain.cpu_adam_seconds(128) + 2.5e-3
        );
        assert_eq!(
            instr_seconds(&s, StreamId(0), &adamw, &measured),
            instr_seconds(&s, StreamId(0), &adamw, &plain)
        );
        let (with, without) = (
            simulate_unverified(&s, &measured).unwrap(),
            simulate_unverified(&s, &plain).unwrap(),
        );
        let extra = with.stream_busy_seconds[1] - without.stream_busy_seconds[1];
        assert!((extra - 2.0 * 2.5e-3).abs() < 1e-12, "{extra}");
        // The figure is a profile's: the JSON keeps it, and a profile without it reads as 0.
        let back = HardwareProfile::from_json(&p.to_json().unwrap()).unwrap();
        assert_eq!(back.cpu_adam_op_s, 2.5e-3);
        let old = HardwareProfile::host().to_json().unwrap();
        assert!(!old.contains("cpu_adam_op_s"), "{old}");
        assert_eq!(HardwareProfile::from_json(&old).unwrap().cpu_adam_op_s, 0.0);
    }

    /// A host profile's measured share of the CPU Adam's rate beside compute
    /// (`cpu_adam_compute_share`) stretches the host optimizer's busy time where its spans
    /// overlap compute kernels: at a quarter, each second beside compute takes four, where the
    /// even split of a profile without the figure takes two. The step's shared term (what the
    /// compute kernels lose, the Adam's own seconds beside them) does not depend on it. A GPU
    /// profile's host optimizer shares no cores, whatever the figure.
    #[test]
    fn simulate_host_adam_beside_compute_keeps_the_profiles_measured_share() {
        let s = host_adam_beside_the_forward_pass();
        let mut p = HardwareProfile::host();
        let even = simulate_unverified(&s, &Roofline::new(p.clone())).unwrap();
        p.cpu_adam_compute_share = Some(0.25);
        let quarter = simulate_unverified(&s, &Roofline::new(p.clone())).unwrap();
        let adam = Roofline::new(p.clone()).cpu_adam_seconds(128);
        let beside = adam.min(even.stream_busy_seconds[0]);
        assert!(beside > 0.0);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
        assert!(close(even.stream_busy_seconds[1], adam + beside));
        assert!(
            close(quarter.stream_busy_seconds[1], adam + 3.0 * beside),
            "{:?} against {adam} + 3 x {beside}",
            quarter.stream_busy_seconds
        );
        assert_eq!(quarter.step_seconds, even.step_seconds);
        assert_eq!(quarter.stream_busy_seconds[0], even.stream_busy_seconds[0]);
        let mut gpu = HardwareProfile::preset("h100").unwrap();
        gpu.cpu_adam_compute_share = Some(0.25);
        let device = simulate_unverified(&s, &Roofline::new(gpu.clone())).unwrap();
        assert_eq!(
            device.stream_busy_seconds[1],
            Roofline::new(gpu).cpu_adam_seconds(128)
        );
        // The figure is a profile's: the JSON keeps it, a profile without it reads as `None`,
        // and one out of (0, 1] is refused with the way out.
        let back = HardwareProfile::from_json(&p.to_json().unwrap()).unwrap();
        assert_eq!(back.cpu_adam_compute_share, Some(0.25));
        let old = HardwareProfile::host().to_json().unwrap();
        assert!(!old.contains("cpu_adam_compute_share"), "{old}");
        assert_eq!(
            HardwareProfile::from_json(&old)
                .unwrap()
                .cpu_adam_compute_share,
            None
        );
        for bad in [0.0, 1.5, f64::NAN] {
            p.cpu_adam_compute_share = Some(bad);
            let err = p.validate().unwrap_err().to_string();
            assert!(err.contains("cpu_adam_compute_share"), "{err}");
            assert!(err.contains("remove it"), "{err}");
        }
    }

    /// [`HostStub`] with the CPU Adam's shares beside compute, copies and both set.
    struct SharesStub(AdamShares);

    impl CostModel for SharesStub {
        fn op_seconds(&self, k: &OpKind, i: &[&TensorType], o: &[&TensorType], d: DType) -> f64 {
            HostStub.op_seconds(k, i, o, d)
        }

        fn copy_seconds(&self, bytes: u64, dir: CopyDir) -> f64 {
            HostStub.copy_seconds(bytes, dir)
        }

        fn cpu_adam_seconds(&self, params: u64) -> f64 {
            HostStub.cpu_adam_seconds(params)
        }

        fn gpu_adam_seconds(&self, params: u64) -> f64 {
            HostStub.gpu_adam_seconds(params)
        }

        fn host_cores(&self) -> Option<f64> {
            HostStub.host_cores()
        }

        fn cpu_adam_shares(&self) -> AdamShares {
            self.0
        }
    }

    /// The CPU Adam (4 s from the start) beside a fetch (1 MiB, 1 s from the start), the
    /// forward pass (3.5 s from the start) and, once the loss is done, an offload (1 MiB,
    /// 0.5 s): 1 s beside compute and a copy, 2.5 s beside compute alone, 0.5 s beside a copy
    /// alone. Each second takes `1 / share` of the share for what runs beside it; the shares
    /// of a profile that measured none keep the pricing of compute alone (a copy costs the
    /// Adam nothing, compute and a copy together what compute does).
    #[test]
    fn simulate_host_adam_beside_copies_keeps_the_measured_shares() {
        let s = schedule(
            tiny_graph(),
            1,
            vec![
                (
                    "compute",
                    StreamKind::Compute,
                    vec![kernel(EMBEDDING), kernel(LINEAR), kernel(LOSS), record(0)],
                ),
                ("h2d", StreamKind::HostToDevice, vec![fetch(0, 1)]),
                (
                    "d2h",
                    StreamKind::DeviceToHost,
                    vec![wait(0), offload(1, 1)],
                ),
                ("host adam", StreamKind::HostOptimizer, vec![kernel(ADAMW)]),
            ],
        );
        let busy = |shares: AdamShares| {
            simulate_unverified(&s, &SharesStub(shares))
                .unwrap()
                .stream_busy_seconds[3]
        };
        let measured = AdamShares {
            compute: 0.5,
            copy: 0.8,
            compute_and_copy: 0.25,
        };
        assert_eq!(busy(measured), 4.0 + 2.5 * 1.0 + 0.5 * 0.25 + 1.0 * 3.0);
        let unmeasured = AdamShares::of(None, None, None);
        assert_eq!(
            unmeasured,
            AdamShares {
                compute: 0.5,
                copy: 1.0,
                compute_and_copy: 0.5,
            }
        );
        assert_eq!(busy(unmeasured), 4.0 + 2.5 + 1.0);
        assert_eq!(
            simulate_unverified(&s, &HostStub)
                .unwrap()
                .stream_busy_seconds[3],
            busy(unmeasured)
        );
        // Beside both, a measured share beside compute stands in for the unmeasured one.
        assert_eq!(AdamShares::of(Some(0.7), None, None).compute_and_copy, 0.7);
        // On a device, nothing is shared whatever the figures.
        let device = simulate_unverified(&s, &Stub).unwrap();
        assert_eq!(device.stream_busy_seconds[3], 4.0);
    }

    /// A host profile's measured shares beside copies and beside compute and copies reach the
    /// cost model, survive the JSON and are refused out of (0, 1] with the way out; a profile
    /// without them reads as `None`.
    #[test]
    fn the_shares_beside_copies_are_a_profiles_figures() {
        let mut p = HardwareProfile::host();
        p.cpu_adam_compute_share = Some(0.6);
        p.cpu_adam_copy_share = Some(0.9);
        p.cpu_adam_compute_copy_share = Some(0.4);
        assert_eq!(
            Roofline::new(p.clone()).cpu_adam_shares(),
            AdamShares {
                compute: 0.6,
                copy: 0.9,
                compute_and_copy: 0.4,
            }
        );
        let back = HardwareProfile::from_json(&p.to_json().unwrap()).unwrap();
        assert_eq!(
            (back.cpu_adam_copy_share, back.cpu_adam_compute_copy_share),
            (Some(0.9), Some(0.4))
        );
        let old = HardwareProfile::host().to_json().unwrap();
        assert!(!old.contains("copy_share"), "{old}");
        let old = HardwareProfile::from_json(&old).unwrap();
        assert_eq!(
            (old.cpu_adam_copy_share, old.cpu_adam_compute_copy_share),
            (None, None)
        );
        for bad in [0.0, 1.5, f64::NAN] {
            let mut q = p.clone();
            q.cpu_adam_copy_share = Some(bad);
            let err = q.validate().unwrap_err().to_string();
            assert!(err.contains("cpu_adam_copy_share"), "{err}");
            assert!(err.contains("remove it"), "{err}");
            let mut q = p.clone();
            q.cpu_adam_compute_copy_share = Some(bad);
            let err = q.validate().unwrap_err().to_string();
            assert!(err.contains("cpu_adam_compute_copy_share"), "{err}");
        }
    }

    /// A device AdamW launch costs 1 s plus 1 s per 128 parameters; `multi` says whether the
    /// backend merges runs of adjacent AdamW ops into one launch.
    struct Launching {
        multi: bool,
    }

    impl CostModel for Launching {
        fn op_seconds(&self, _: &OpKind, _: &[&TensorType], _: &[&TensorType], _: DType) -> f64 {
            0.25
        }

        fn copy_seconds(&self, _: u64, _: CopyDir) -> f64 {
            0.0
        }

        fn cpu_adam_seconds(&self, params: u64) -> f64 {
            params as f64 / 32.0
        }

        fn gpu_adam_seconds(&self, params: u64) -> f64 {
            1.0 + params as f64 / 128.0
        }

        fn multi_tensor_adamw(&self) -> bool {
            self.multi
        }
    }

    /// Four AdamW ops on parameters of 128, 16, 16 and 16 elements, the last with another
    /// weight decay; their ids in order.
    fn adamw_graph() -> (Graph, [OpId; 4]) {
        let mut g = Graph::new(GraphInfo {
            model: "tiny".into(),
            batch: 2,
            seq: 4,
        });
        let head = g.add_block("lm_head", BlockKind::Head);
        let mut ops = [OpId(0); 4];
        for (i, (shape, weight_decay)) in [
            (vec![8u64, 16], 0.0),
            (vec![16], 0.0),
            (vec![16], 0.0),
            (vec![16], 0.1),
        ]
        .into_iter()
        .enumerate()
        {
            let name = format!("p{i}");
            let p = g.add_param(&name, shape.clone(), DType::F32, head);
            let p = g.param(p).value;
            let ty = TensorType::new(shape, DType::F32);
            let grad = g.add_state(format!("{name}.grad"), ty.clone());
            let m = g.add_state(format!("{name}.m"), ty.clone());
            let v = g.add_state(format!("{name}.v"), ty);
            let adamw = OpKind::AdamW {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay,
                clipped: false,
            };
            g.add_op_multi(adamw, &[p, grad, m, v], &[], head, Phase::Optimizer)
                .unwrap();
            ops[i] = OpId(g.op_count() as u32 - 1);
        }
        (g, ops)
    }

    /// Runs of adjacent AdamW ops with equal kinds are one launch on a device stream: a record
    /// between two ops splits the run, another weight decay starts a new one, and the host
    /// optimizer's CPU Adam has no runs. With a merging backend the run's first op carries the
    /// whole run (one launch overhead, every parameter's bandwidth) and the others cost
    /// nothing; without one, every op pays its own launch.
    #[test]
    fn simulate_prices_a_run_of_device_adamw_as_one_launch() {
        let (graph, [a, b, c, d]) = adamw_graph();
        let instrs = |event: Instr| vec![kernel(a), kernel(b), event, kernel(c), kernel(d)];
        let s = schedule(
            graph,
            1,
            vec![
                ("compute", StreamKind::Compute, instrs(record(0))),
                ("host adam", StreamKind::HostOptimizer, instrs(wait(0))),
            ],
        );
        assert_eq!(device_adamw_runs(&s, StreamId(0)), vec![0..2, 3..4, 4..5]);
        assert!(device_adamw_runs(&s, StreamId(1)).is_empty());
        assert!(device_adamw_runs(&s, StreamId(7)).is_empty());

        let merging = Launching { multi: true };
        // a + b: 1 + 144/128; c: 1 + 16/128; d: 1 + 16/128.
        assert_eq!(
            stream_seconds(&s, StreamId(0), &merging),
            vec![2.125, 0.0, 0.0, 1.125, 1.125]
        );
        let alone = Launching { multi: false };
        assert_eq!(
            stream_seconds(&s, StreamId(0), &alone),
            vec![2.0, 1.125, 0.0, 1.125, 1.125]
        );
        // The host stream's CPU Adam is priced op by op either way.
        assert_eq!(
            stream_seconds(&s, StreamId(1), &merging),
            vec![4.0, 0.5, 0.0, 0.5, 0.5]
        );
        let sim = simulate_unverified(&s, &merging).unwrap();
        assert_eq!(sim.stream_busy_seconds[0], 4.375);
        let sim = simulate_unverified(&s, &alone).unwrap();
        assert_eq!(sim.stream_busy_seconds[0], 5.375);
    }

    #[test]
    fn only_a_gpu_profile_merges_adamw_launches() {
        let gpu = Roofline::new(HardwareProfile::preset("a100-80gb").unwrap());
        assert!(gpu.multi_tensor_adamw());
        let host = Roofline::new(HardwareProfile::preset("host").unwrap());
        assert!(!host.multi_tensor_adamw());
        assert!(!Stub.multi_tensor_adamw());
    }
}
