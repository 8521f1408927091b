//! Temporary timing harness (not committed).
#[cfg(test)]
mod t {
    use crate::kernels::*;
    use std::time::Instant;
    fn cpu() -> f64 {
        let s = std::fs::read_to_string("/proc/self/stat").unwrap();
        let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
        (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
    }
    fn time(name: &str, mut f: impl FnMut()) {
        f();
        let n = 40;
        let c0 = cpu();
        let t0 = Instant::now();
        for _ in 0..n { f(); }
        let wall = t0.elapsed().as_secs_f64() / n as f64;
        let c = (cpu() - c0) / n as f64;
        println!("{name:<28} wall {:8.2} ms  cpu {:8.2} ms", wall * 1e3, c * 1e3);
    }
    #[test]
    fn mm() {
        use crate::kernels::math::{matmul, Mat};
        let r = |k: usize| (0..k).map(|i| ((i * 2654435761usize) % 1000) as f32 * 1e-3 - 0.5).collect::<Vec<f32>>();
        let (n, c, v) = (2048usize, 256usize, 8192usize);
        let x = r(n * c); let w = r(v * c); let dy = r(n * v);
        let mut y = vec![0.0; n * v]; let mut dx = vec![0.0; n * c]; let mut dw = vec![0.0; v * c];
        time("fwd y=x W^T (rhs rs=1 cs=C)", || matmul(&mut y, Mat{data:&x,rs:c,cs:1}, Mat{data:&w,rs:1,cs:c}, n, v, c, false));
        time("dx = dy W (rhs rs=C cs=1)", || matmul(&mut dx, Mat{data:&dy,rs:v,cs:1}, Mat{data:&w,rs:c,cs:1}, n, c, v, false));
        time("dW = dy^T x (lhs rs=1 cs=V)", || matmul(&mut dw, Mat{data:&dy,rs:1,cs:v}, Mat{data:&x,rs:c,cs:1}, v, c, n, false));
        let mut dwt = vec![0.0; v * c];
        time("dW^T = x^T dy (lhs rs=1 cs=C)", || matmul(&mut dwt, Mat{data:&x,rs:1,cs:c}, Mat{data:&dy,rs:v,cs:1}, c, v, n, false));
        let wio = r(c * v);
        time("fwd InOut y=x W (rhs rs=V cs=1)", || matmul(&mut y, Mat{data:&x,rs:c,cs:1}, Mat{data:&wio,rs:v,cs:1}, n, v, c, false));
        time("dx InOut = dy W^T (rhs rs=1 cs=V)", || matmul(&mut dx, Mat{data:&dy,rs:v,cs:1}, Mat{data:&wio,rs:1,cs:v}, n, c, v, false));
    }
    #[test]
    fn bench() {
        let (b, t, c, h) = (8usize, 256usize, 256usize, 4usize);
        let n = b * t;
        let r = |k: usize| (0..k).map(|i| ((i * 2654435761usize) % 1000) as f32 * 1e-3 - 0.5).collect::<Vec<f32>>();
        let x = r(n * c);
        let d = AttentionDims { batch: b, seq: t, n_heads: h, n_kv_heads: h, head_dim: c / h, window: None };
        let qkv = r(n * 3 * c).iter().map(|x| x * 4.0).collect::<Vec<_>>();
        let mut att = vec![0.0; n * c]; let mut lse = vec![0.0; d.lse_len()];
        time("attention fwd", || attention_forward_packed(&mut att, &mut lse, &qkv, d));
        let mut dqkv = vec![0.0; n * 3 * c];
        time("attention bwd", || attention_backward_packed(&mut dqkv, &x, &qkv, &att, &lse, d));
        let sub = dqkv.iter().filter(|v| v.is_subnormal()).count();
        let sub2 = att.iter().filter(|v| v.is_subnormal()).count();
        println!("subnormal in dqkv {sub}, att {sub2}; max |dqkv| {}", dqkv.iter().fold(0.0f32, |a, &b| a.max(b.abs())));
        let mut buf = vec![0.5f32; 1 << 20];
        time("exp 1M plain", || { for x in buf.iter_mut() { *x = crate::kernels::math::exp(*x - 0.5); } });
        time("exp 1M fast", || crate::kernels::math::fast(|| { for x in buf.iter_mut() { *x = crate::kernels::math::exp(*x - 0.5); } }));
        time("libm exp 1M", || { for x in buf.iter_mut() { *x = (*x - 0.5).exp(); } });
        let mut rng = crate::kernels::testutil::Rng::new(5);
        let qkv2 = rng.vec(n * 3 * c); let x2 = rng.vec(n * c);
        time("attention fwd randn", || attention_forward_packed(&mut att, &mut lse, &qkv2, d));
        time("attention bwd randn", || attention_backward_packed(&mut dqkv, &x2, &qkv2, &att, &lse, d));
    }
}
