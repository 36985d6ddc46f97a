//! How a census names types, and the steps of a referrer chain.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple, PyType};

/// The name a census gives a type: `module.qualname`, builtins bare.
pub fn type_name(ty: &Bound<'_, PyType>) -> String {
    let qual = ty
        .getattr("__qualname__")
        .and_then(|q| q.extract::<String>())
        .unwrap_or_else(|_| "?".into());
    match ty.getattr("__module__").and_then(|m| m.extract::<String>()) {
        Ok(m) if m != "builtins" => format!("{m}.{qual}"),
        _ => qual,
    }
}

pub(super) fn describe_leaf(census_name: &str, obj: &Bound<'_, PyAny>) -> String {
    // The census's own name (`torch.Tensor[cpu]`), so the chain and the
    // type counts agree; arrays and tensors also give their shape (asked of
    // those only: any other object's attributes may run its code).
    if !(census_name.starts_with("torch") || census_name.starts_with("numpy")) {
        return census_name.to_string();
    }
    match obj.getattr("shape").and_then(|s| s.str()) {
        Ok(shape) => format!("{census_name} {shape}"),
        _ => census_name.to_string(),
    }
}

/// `obj.__dict__` by the generic lookup, which never calls the class's
/// `__getattr__`: a lazy proxy (openai's, in vLLM's API server) answers a
/// missing attribute by importing its module, and a census must not run
/// the server's code.
pub(super) fn instance_dict<'py>(obj: &Bound<'py, PyAny>) -> Option<Bound<'py, PyDict>> {
    let name = pyo3::types::PyString::new(obj.py(), "__dict__");
    // SAFETY: both live, the GIL held; a new reference or NULL with an
    // error set, which `from_owned_ptr_or_err` takes.
    let dict = unsafe {
        Bound::from_owned_ptr_or_err(
            obj.py(),
            pyo3::ffi::PyObject_GenericGetAttr(obj.as_ptr(), name.as_ptr()),
        )
    };
    dict.ok()?.cast_into::<PyDict>().ok()
}

/// A dict key as the chain shows it: the value of a string, number or
/// bytes key, else its type (any other `repr` may run the server's code).
fn key_text(key: &Bound<'_, PyAny>) -> String {
    let plain = key.is_exact_instance_of::<pyo3::types::PyString>()
        || key.is_exact_instance_of::<pyo3::types::PyInt>()
        || key.is_exact_instance_of::<pyo3::types::PyFloat>()
        || key.is_exact_instance_of::<pyo3::types::PyBytes>();
    if !plain {
        return format!("<{}>", type_name(&key.get_type()));
    }
    let t = key.repr().map(|r| r.to_string()).unwrap_or_default();
    if t.chars().count() > 40 {
        format!("{}...", t.chars().take(40).collect::<String>())
    } else {
        t
    }
}

/// A global's or attribute's name: a string key as it is, any other by
/// [`key_text`].
fn global_name(key: &Bound<'_, PyAny>) -> String {
    match key.cast::<pyo3::types::PyString>() {
        Ok(s) => s.to_string(),
        Err(_) => key_text(key),
    }
}

/// Whether `holder` is a module's globals, where a chain ends.
pub(super) fn is_module_globals(holder: &Bound<'_, PyAny>) -> bool {
    holder.cast::<PyDict>().is_ok_and(|d| {
        d.contains("__builtins__").unwrap_or(false) && d.contains("__name__").unwrap_or(false)
    })
}

/// A module's name from its globals. A script that multiprocessing's spawn
/// runs in a worker is `__mp_main__` there: it is named by its file instead,
/// as the user knows it.
fn module_name(globals: &Bound<'_, PyDict>) -> String {
    let get = |k: &str| {
        globals
            .get_item(k)
            .ok()
            .flatten()
            .and_then(|v| v.extract::<String>().ok())
    };
    let name = get("__name__").unwrap_or_default();
    match get("__file__") {
        Some(file) if name == "__mp_main__" => std::path::Path::new(&file)
            .file_name()
            .map_or(file.clone(), |f| f.to_string_lossy().into_owned()),
        _ => name,
    }
}

/// How `holder` holds `child`, and whether `holder` is a module's globals.
pub(super) fn describe_holder(
    holder: &Bound<'_, PyAny>,
    child: &Bound<'_, PyAny>,
) -> (String, bool) {
    if let Ok(d) = holder.cast::<PyDict>() {
        let key = d.iter().find(|(_, v)| v.is(child)).map(|(k, _)| k);
        let module = is_module_globals(holder).then(|| module_name(d));
        return match (module, key) {
            (Some(m), Some(k)) => (format!("module {m} global {}", global_name(&k)), true),
            (Some(m), None) => (format!("module {m} globals"), true),
            (None, Some(k)) => (format!("dict[{}] ({} items)", key_text(&k), d.len()), false),
            (None, None) => (format!("dict ({} items)", d.len()), false),
        };
    }
    if let Ok(l) = holder.cast::<PyList>() {
        let i = l.iter().position(|v| v.is(child));
        return (
            match i {
                Some(i) => format!("list[{i}] ({} items)", l.len()),
                None => format!("list ({} items)", l.len()),
            },
            false,
        );
    }
    if let Ok(t) = holder.cast::<PyTuple>() {
        let i = t
            .iter()
            .position(|v| v.is(child))
            .map_or("?".into(), |i| i.to_string());
        return (format!("tuple[{i}] ({} items)", t.len()), false);
    }
    let name = type_name(&holder.get_type());
    let attr = instance_dict(holder).and_then(|d| {
        d.iter()
            .find(|(_, v)| v.is(child))
            .map(|(k, _)| global_name(&k))
    });
    (
        match attr {
            Some(a) => format!("{name}.{a}"),
            None => name,
        },
        false,
    )
}

/// `Owner.attr`, when `dict` is `owner`'s attributes (an instance's
/// `__dict__`, a class's namespace) and holds `value` under `attr`: a walk
/// down from the modules passes through the dict, and one step reads
/// better than two.
pub(super) fn attribute_step(
    owner: &Bound<'_, PyAny>,
    dict: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
) -> Option<String> {
    let d = dict.cast::<PyDict>().ok()?;
    let key = d.iter().find(|(_, v)| v.is(value)).map(|(k, _)| k)?;
    let attr = key.extract::<String>().ok()?;
    let name = match owner.cast::<PyType>() {
        // A class's namespace is behind a mappingproxy: ask the class.
        // (Its namespace, not the attribute: a descriptor's `__get__`
        // would run.)
        Ok(ty) => ty
            .getattr("__dict__")
            .ok()?
            .get_item(attr.as_str())
            .ok()?
            .is(value)
            .then(|| type_name(ty))?,
        Err(_) => instance_dict(owner)?
            .is(dict)
            .then(|| type_name(&owner.get_type()))?,
    };
    Some(format!("{name}.{attr}"))
}
