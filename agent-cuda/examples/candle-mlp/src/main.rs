//! A candle (CPU) inference program with the oomscope agent: a
//! random-weight MLP, one forward pass per request, each request marked
//! with `agent.request(...)`. With `--leak-mib N` every request leaves N
//! MiB behind in a response cache that never evicts: the leak oomscope
//! should find, at N MiB per request.
//!
//! ```text
//! oomscope-candle-example [--requests 500] [--leak-mib 0] [--name candle-mlp]
//! ```
//! The collector is `OOMSCOPE_COLLECTOR` (default http://127.0.0.1:4317).

use std::collections::HashMap;
use std::process::ExitCode;

use candle_core::{DType, Device, Tensor};
use oomscope_agent_cuda::agent::DEFAULT_SHUTDOWN_WAIT;
use oomscope_agent_cuda::{pb, Agent, AgentConfig};

/// The model's widths: small enough that 500 requests take a few seconds.
const D_MODEL: usize = 256;
const D_HIDDEN: usize = 1024;
const PROMPT_TOKENS: usize = 32;

struct Args {
    requests: u64,
    leak_mib: usize,
    name: String,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        requests: 500,
        leak_mib: 0,
        name: "candle-mlp".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--requests" => {
                a.requests = value()?.parse().map_err(|e| format!("--requests: {e}"))?
            }
            "--leak-mib" => {
                a.leak_mib = value()?.parse().map_err(|e| format!("--leak-mib: {e}"))?
            }
            "--name" => a.name = value()?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

struct Mlp {
    w1: Tensor,
    w2: Tensor,
}

impl Mlp {
    fn random(device: &Device) -> candle_core::Result<Mlp> {
        Ok(Mlp {
            w1: Tensor::randn(0f32, 0.02, (D_MODEL, D_HIDDEN), device)?,
            w2: Tensor::randn(0f32, 0.02, (D_HIDDEN, D_MODEL), device)?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.matmul(&self.w1)?.relu()?.matmul(&self.w2)
    }

    fn bytes(&self) -> u64 {
        ((self.w1.elem_count() + self.w2.elem_count()) * DType::F32.size_in_bytes()) as u64
    }
}

fn serve(agent: &Agent, a: &Args) -> candle_core::Result<()> {
    let device = Device::Cpu;
    let model = {
        let mut load = agent.load(pb::Model {
            name: "random-mlp".into(),
            dtype: "float32".into(),
            ..Default::default()
        });
        Mlp::random(&device).inspect_err(|e| load.fail(e))?
    };
    eprintln!("model: {} bytes of weights", model.bytes());
    // The bug the leak flag plants: a cache keyed by request that is never
    // evicted (a bounded cache, an LRU, fixes it).
    let mut responses: HashMap<u64, Vec<u8>> = HashMap::new();
    for id in 0..a.requests {
        let mut request = agent.request(id, PROMPT_TOKENS as u64);
        let x = Tensor::randn(0f32, 1.0, (PROMPT_TOKENS, D_MODEL), &device)?;
        let y = model.forward(&x)?;
        // One output token per prompt row: the argmax of its logits.
        let tokens = y.argmax(1)?.to_vec1::<u32>()?;
        request.set_output_tokens(tokens.len() as u64);
        if a.leak_mib > 0 {
            let mut kept = vec![0u8; a.leak_mib << 20];
            // Resident, as a real response body is.
            kept.iter_mut().step_by(4096).for_each(|b| *b = 1);
            responses.insert(id, kept);
        }
    }
    eprintln!(
        "{} requests served, {} responses cached",
        a.requests,
        responses.len()
    );
    Ok(())
}

fn main() -> ExitCode {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    // OOMSCOPE_COLLECTOR and OOMSCOPE_NAME apply; a bad URL stops here.
    let agent = match Agent::start(AgentConfig::new(a.name.clone())) {
        Ok(agent) => agent,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let result = serve(&agent, &a);
    let code = i32::from(result.is_err());
    if let Err(e) = &result {
        eprintln!("error: {e}");
    }
    let acked = agent.shutdown("done", code, DEFAULT_SHUTDOWN_WAIT);
    eprintln!("oomscope: everything acked: {acked}");
    ExitCode::from(code as u8)
}
