//! `oomscope.request`, the context manager that marks one request. Its
//! enter and exit are all a request pays on the server's thread, so the
//! class is native: as a Python class around the same two native calls it
//! cost the loop of `bench/overhead.py` about twice as much (BENCHMARKS.md).

use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::prelude::*;
use pyo3::types::PyInt;

/// How many requests were given no id (they are named "req-1", "req-2", ...).
static UNNAMED: AtomicU64 = AtomicU64::new(0);

/// The longest error text a request's end keeps, in characters.
const ERROR_CHARS: usize = 500;

/// Marks one request: ``with oomscope.request(id=..., prompt_tokens=...,
/// max_tokens=...) as r: ...; r.output_tokens = n``.
///
/// An out-of-memory error raised inside is reported (observer arguments,
/// allocator stats, snapshot summary, context and the error text), spooled
/// and acked within ``oom_wait_s`` before it propagates. Without a running
/// agent it does nothing.
#[pyclass(module = "oomscope", name = "request", subclass)]
pub struct Request {
    #[pyo3(get, set)]
    id: String,
    #[pyo3(get)]
    prompt_tokens: u64,
    #[pyo3(get)]
    max_tokens: u64,
    #[pyo3(get)]
    output_tokens: u64,
}

/// `int(value or 0)`: how the counts were always read (None, a float or a
/// numpy integer all do).
fn count(value: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
    match value {
        Some(v) if v.is_truthy()? => v.py().get_type::<PyInt>().call1((v,))?.extract(),
        _ => Ok(0),
    }
}

#[pymethods]
impl Request {
    #[new]
    #[pyo3(signature = (id = None, prompt_tokens = None, max_tokens = None))]
    fn new(
        id: Option<&Bound<'_, PyAny>>,
        prompt_tokens: Option<&Bound<'_, PyAny>>,
        max_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let id = match id.filter(|i| !i.is_none()) {
            Some(i) => i.str()?.to_string(),
            None => format!("req-{}", UNNAMED.fetch_add(1, Ordering::Relaxed) + 1),
        };
        Ok(Request {
            id,
            prompt_tokens: count(prompt_tokens)?,
            max_tokens: count(max_tokens)?,
            output_tokens: 0,
        })
    }

    #[setter]
    fn set_prompt_tokens(&mut self, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.prompt_tokens = count(Some(value))?;
        Ok(())
    }

    #[setter]
    fn set_max_tokens(&mut self, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.max_tokens = count(Some(value))?;
        Ok(())
    }

    #[setter]
    fn set_output_tokens(&mut self, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.output_tokens = count(Some(value))?;
        Ok(())
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        if let Some(a) = crate::current() {
            a.request_begin(&slf.id, slf.prompt_tokens, slf.max_tokens);
        }
        slf
    }

    /// Ends the request; an exception goes on (never suppressed).
    #[pyo3(signature = (exc_type = None, exc = None, _tb = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        let Some(a) = crate::current() else {
            return false;
        };
        let error = match exc.filter(|e| !e.is_none()) {
            Some(e) => exit_error(py, exc_type, e),
            None => String::new(),
        };
        a.request_end(&self.id, self.output_tokens, &error);
        false
    }
}

/// "Type: message" for the end of a request or a phase (`oomscope.phase`
/// calls it too), after the Python side has reported the error if it is an
/// out-of-memory one (it knows torch's and the host's kinds).
#[pyfunction]
#[pyo3(signature = (exc_type, exc))]
pub fn exit_error(
    py: Python<'_>,
    exc_type: Option<&Bound<'_, PyAny>>,
    exc: &Bound<'_, PyAny>,
) -> String {
    // report_if_oom never raises; should its import fail, the end still goes.
    if let Ok(hooks) = py.import("oomscope._hooks") {
        let _ = hooks.call_method1("report_if_oom", (exc,));
    }
    let name = exc_type
        .and_then(|t| t.getattr("__name__").ok())
        .map(|n| n.to_string())
        .unwrap_or_default();
    let text = exc.str().map(|s| s.to_string()).unwrap_or_default();
    format!(
        "{name}: {}",
        text.chars().take(ERROR_CHARS).collect::<String>()
    )
}
