//! Python objects as JSON values, so the dicts PyTorch hands out
//! (`memory._snapshot()`, a request context) go through the same
//! `agent_core::torch` functions `oomscope replay` uses on capture files.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::{Map, Number, Value};

/// Nesting deeper than this becomes text: snapshots are 5 levels deep, and a
/// cyclic or absurd structure must not recurse without end.
const MAX_DEPTH: usize = 32;

/// Converts dicts, lists, tuples, numbers, strings, booleans and None; any
/// other object becomes its `str()` (a `torch.device`, an enum), and one whose
/// `str()` fails becomes null. Never raises.
pub fn to_json(obj: &Bound<'_, PyAny>) -> Value {
    convert(obj, 0)
}

fn convert(obj: &Bound<'_, PyAny>, depth: usize) -> Value {
    if obj.is_none() {
        return Value::Null;
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Value::Bool(b.is_true());
    }
    if obj.is_instance_of::<PyInt>() {
        if let Ok(i) = obj.extract::<i64>() {
            return Value::Number(i.into());
        }
        if let Ok(u) = obj.extract::<u64>() {
            return Value::Number(u.into());
        }
        return obj
            .extract::<f64>()
            .ok()
            .and_then(Number::from_f64)
            .map_or(Value::Null, Value::Number);
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Number::from_f64(f.value()).map_or(Value::Null, Value::Number);
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return s
            .extract::<String>()
            .map(Value::String)
            .unwrap_or(Value::Null);
    }
    if depth >= MAX_DEPTH {
        return text(obj);
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut m = Map::with_capacity(d.len());
        for (k, v) in d.iter() {
            let key = match k.cast::<PyString>() {
                Ok(s) => s.to_string(),
                Err(_) => k.str().map(|s| s.to_string()).unwrap_or_default(),
            };
            m.insert(key, convert(&v, depth + 1));
        }
        return Value::Object(m);
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return Value::Array(l.iter().map(|v| convert(&v, depth + 1)).collect());
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return Value::Array(t.iter().map(|v| convert(&v, depth + 1)).collect());
    }
    text(obj)
}

fn text(obj: &Bound<'_, PyAny>) -> Value {
    obj.str()
        .map(|s| Value::String(s.to_string()))
        .unwrap_or(Value::Null)
}
