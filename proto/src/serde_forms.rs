//! How some generated fields read and write in their serde form (JSON and
//! Python objects), where the derive alone would not give the documented
//! shape. `tests/bootstrap.rs` puts these on the fields by their proto type.

use std::collections::HashMap;
use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};

/// A proto enum that reads and writes as its lowercase value name: the
/// proto name without the enum's prefix (`PID_VIEW_OWN` is `"own"`).
pub trait NamedEnum: Sized + Into<i32> + TryFrom<i32> + Copy {
    /// The enum's value prefix, as in the `.proto` (`"PID_VIEW_"`).
    const PREFIX: &'static str;
    fn proto_name(&self) -> &'static str;
    fn from_proto_name(name: &str) -> Option<Self>;
}

/// An enum field (prost stores it as i32) as its lowercase name; a number no
/// value of this build names (a newer peer's) stays a number.
pub fn enum_name<T: NamedEnum, S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
    match T::try_from(*v) {
        Ok(e) => {
            let name = e.proto_name();
            s.serialize_str(&name[T::PREFIX.len().min(name.len())..].to_ascii_lowercase())
        }
        Err(_) => s.serialize_i32(*v),
    }
}

/// Reads an enum field from its lowercase name, its proto name, or its number.
pub fn enum_from_name<'de, T: NamedEnum, D: Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
    struct V<T>(std::marker::PhantomData<T>);
    impl<T: NamedEnum> Visitor<'_> for V<T> {
        type Value = i32;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "a {}* value name or number", T::PREFIX)
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<i32, E> {
            let upper = s.to_ascii_uppercase();
            T::from_proto_name(&format!("{}{upper}", T::PREFIX))
                .or_else(|| T::from_proto_name(&upper))
                .map(Into::into)
                .ok_or_else(|| E::invalid_value(de::Unexpected::Str(s), &self))
        }
        fn visit_i64<E: de::Error>(self, n: i64) -> Result<i32, E> {
            i32::try_from(n).map_err(|_| E::invalid_value(de::Unexpected::Signed(n), &self))
        }
        fn visit_u64<E: de::Error>(self, n: u64) -> Result<i32, E> {
            i32::try_from(n).map_err(|_| E::invalid_value(de::Unexpected::Unsigned(n), &self))
        }
    }
    d.deserialize_any(V::<T>(std::marker::PhantomData))
}

/// A map with its keys in order: the same message always prints the same text.
pub fn sorted<V: Serialize, S: Serializer>(
    m: &HashMap<String, V>,
    s: S,
) -> Result<S::Ok, S::Error> {
    let mut keys: Vec<&String> = m.keys().collect();
    keys.sort();
    let mut out = s.serialize_map(Some(keys.len()))?;
    for k in keys {
        out.serialize_entry(k, &m[k])?;
    }
    out.end()
}

/// A map of numbers in key order, a whole number (a byte count) as an
/// integer; NaN and infinities, which JSON cannot carry, are left out.
pub fn sorted_numbers<S: Serializer>(m: &HashMap<String, f64>, s: S) -> Result<S::Ok, S::Error> {
    // 2^53: beyond it an f64 no longer holds every integer exactly.
    const EXACT: f64 = 9_007_199_254_740_992.0;
    let mut keys: Vec<&String> = m.keys().filter(|k| m[*k].is_finite()).collect();
    keys.sort();
    let mut out = s.serialize_map(Some(keys.len()))?;
    for k in keys {
        let v = m[k];
        match v.fract() == 0.0 && v.abs() <= EXACT {
            true => out.serialize_entry(k, &(v as i64))?,
            false => out.serialize_entry(k, &v)?,
        }
    }
    out.end()
}

/// A field that holds JSON text, as the JSON value itself: an object, or
/// null for anything else (empty text among it).
pub fn json_text<S: Serializer>(text: &str, s: S) -> Result<S::Ok, S::Error> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(v @ serde_json::Value::Object(_)) => v.serialize(s),
        _ => s.serialize_none(),
    }
}

/// Reads [`json_text`]'s form back: an object as its text, null as "".
pub fn json_text_from<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    match Option::<serde_json::Value>::deserialize(d)? {
        None | Some(serde_json::Value::Null) => Ok(String::new()),
        Some(v) => Ok(v.to_string()),
    }
}

/// Implements [`NamedEnum`] for generated enums, each with its value prefix.
macro_rules! named_enums {
    ($($t:ident = $prefix:literal),* $(,)?) => {$(
        impl NamedEnum for crate::v1::$t {
            const PREFIX: &'static str = $prefix;
            fn proto_name(&self) -> &'static str {
                self.as_str_name()
            }
            fn from_proto_name(name: &str) -> Option<Self> {
                Self::from_str_name(name)
            }
        }
    )*};
}

// Every enum of the `.proto` files: the generated fields name this impl, so
// an enum left out here does not compile with the `serde` feature.
named_enums!(PidView = "PID_VIEW_");
