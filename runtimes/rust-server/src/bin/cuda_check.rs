//! GPU-machine check (tests/device/cuda.part.sh): launches a hand-written
//! PTX kernel on a TrackedSlice and checks the result, then times a tracked
//! pool alloc+free (cache hit) against raw cuMemAlloc+cuMemFree of 1 MiB.
//! Prints `key=value` lines; exits 2 without a GPU, 1 on a wrong result.

use std::time::Instant;

use cudarc::driver::{result, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use oomscope_agent_cuda::{Cuda, DeviceMemory, Tag, TrackingPool};

const PTX: &str = r#"
.version 8.0
.target sm_80
.address_size 64
.visible .entry add_one(.param .u64 p, .param .u32 n)
{
    .reg .pred %p<2>; .reg .f32 %f<3>; .reg .b32 %r<6>; .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [p];
    ld.param.u32 %r2, [n];
    mov.u32 %r3, %ctaid.x; mov.u32 %r4, %ntid.x; mov.u32 %r5, %tid.x;
    mad.lo.s32 %r1, %r3, %r4, %r5;
    setp.ge.u32 %p1, %r1, %r2;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd4, %rd2, %rd3;
    ld.global.f32 %f1, [%rd4];
    add.f32 %f2, %f1, 0f3F800000;
    st.global.f32 [%rd4], %f2;
DONE:
    ret;
}
"#;

const ITERS: u32 = 20_000;

fn main() {
    let cuda = match Cuda::open(0) {
        Ok(c) => c,
        Err(e) => {
            println!("device=absent reason={e}");
            std::process::exit(2);
        }
    };
    println!("device={}", cuda.info().name);
    let ctx = cuda.context().clone();
    let stream = cuda.default_stream();
    let pool = TrackingPool::new(cuda);
    let n: u32 = 1 << 20;
    let mut x = pool
        .alloc::<f32>(n as usize, Tag::Activation)
        .expect("alloc");
    let host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    unsafe { pool.device().copy_to_device(x.device_ptr(), &host) }.expect("htod");
    let module = ctx.load_module(Ptx::from_src(PTX)).expect("load PTX");
    let f = module.load_function("add_one").expect("function");
    let mut launch = stream.launch_builder(&f);
    launch.arg(&mut x).arg(&n);
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.expect("launch");
    stream.synchronize().expect("sync");
    let mut back = vec![0f32; n as usize];
    unsafe { pool.device().copy_to_host(&mut back, x.device_ptr()) }.expect("dtoh");
    let wrong = back
        .iter()
        .enumerate()
        .filter(|(i, v)| **v != *i as f32 + 1.0)
        .count();
    println!("kernel_wrong={wrong}");
    drop(x);

    let bytes = 1usize << 20;
    drop(pool.alloc::<u8>(bytes, Tag::Workspace).unwrap());
    let t = Instant::now();
    for _ in 0..ITERS {
        drop(pool.alloc::<u8>(bytes, Tag::Workspace).unwrap());
    }
    let tracked_ns = t.elapsed().as_nanos() as f64 / ITERS as f64;
    ctx.bind_to_thread().unwrap();
    let t = Instant::now();
    for _ in 0..ITERS / 10 {
        let p = unsafe { result::malloc_async(stream.cu_stream(), bytes) }.unwrap();
        unsafe { result::free_async(p, stream.cu_stream()) }.unwrap();
    }
    stream.synchronize().unwrap();
    let raw_ns = t.elapsed().as_nanos() as f64 / (ITERS / 10) as f64;
    println!(
        "tracked_alloc_free_ns={tracked_ns:.0} raw_stream_alloc_free_ns={raw_ns:.0} ratio={:.3}",
        tracked_ns / raw_ns
    );
    let s = pool.stats();
    println!(
        "stats allocated={} reserved={} device_allocs={}",
        s.allocated_bytes, s.reserved_bytes, s.num_device_alloc
    );
    std::process::exit(if wrong == 0 { 0 } else { 1 });
}
