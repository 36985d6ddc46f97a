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
    // type counts agree; arrays and tensors also give their shape.
    match obj.getattr("shape").and_then(|s| s.str()) {
        Ok(shape) if census_name.starts_with("torch") || census_name.starts_with("numpy") => {
            format!("{census_name} {shape}")
        }
        _ => census_name.to_string(),
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
    let short = |o: &Bound<'_, PyAny>| -> String {
        let t = o.repr().map(|r| r.to_string()).unwrap_or_default();
        if t.chars().count() > 40 {
            format!("{}...", t.chars().take(40).collect::<String>())
        } else {
            t
        }
    };
    if let Ok(d) = holder.cast::<PyDict>() {
        let key = d.iter().find(|(_, v)| v.is(child)).map(|(k, _)| k);
        let module = is_module_globals(holder).then(|| module_name(d));
        return match (module, key) {
            (Some(m), Some(k)) => (
                format!(
                    "module {m} global {}",
                    k.str().map(|s| s.to_string()).unwrap_or_default()
                ),
                true,
            ),
            (Some(m), None) => (format!("module {m} globals"), true),
            (None, Some(k)) => (format!("dict[{}] ({} items)", short(&k), d.len()), false),
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
    let attr = holder.getattr("__dict__").ok().and_then(|d| {
        d.cast::<PyDict>().ok().and_then(|d| {
            d.iter()
                .find(|(_, v)| v.is(child))
                .map(|(k, _)| k.to_string())
        })
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
        Ok(ty) => ty
            .getattr(attr.as_str())
            .ok()?
            .is(value)
            .then(|| type_name(ty))?,
        Err(_) => owner
            .getattr("__dict__")
            .ok()?
            .is(dict)
            .then(|| type_name(&owner.get_type()))?,
    };
    Some(format!("{name}.{attr}"))
}
