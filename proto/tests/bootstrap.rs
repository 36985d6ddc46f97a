//! Regenerates `src/generated` from `proto/` and fails when the committed code
//! was stale, in the manner of tokio-console's console-api.

use std::path::PathBuf;

use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::DescriptorProto;
use tonic_prost_build::Builder;

/// Every message, oneof and enum gets serde, behind the crate's `serde`
/// feature so that agents which never write JSON do not compile it.
const DERIVE: &str =
    r#"#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]"#;
/// A field missing from the input takes its proto default, as on the wire
/// (enums and oneofs cannot carry `default`, so messages only).
const DEFAULT: &str = r#"#[cfg_attr(feature = "serde", serde(default))]"#;
/// A oneof's member sits in its message under its own field name, as in the
/// proto3 JSON mapping (`{"time_ns": 1, "oom": {...}}`), rather than nested
/// under the oneof's name.
const FLATTEN: &str = r#"#[cfg_attr(feature = "serde", serde(flatten))]"#;

#[test]
fn generated_code_is_up_to_date() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let protos = ["agent.proto", "memory.proto", "query.proto"]
        .map(|f| root.join("proto/oomscope/v1").join(f));
    let out = root.join("src/generated");

    let fds = protox::compile(&protos, [root.join("proto")]).expect("protos compile");
    let tmp = std::env::temp_dir().join(format!("oomscope-proto-gen-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut builder = tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // The generated `connect(dst)` constructor would clash with the
        // `Connect` rpc; clients are built from a Channel instead.
        .build_transport(false)
        .type_attribute(".", DERIVE)
        .message_attribute(".", DEFAULT)
        // `bytes` fields as `Bytes`, which serde writes as bytes (Python
        // `bytes` through pythonize) rather than as a list of numbers.
        .bytes(".")
        // A wire-only encoding that the collector undoes before storing:
        // JSON and Python objects never show it.
        .field_attribute(
            ".oomscope.v1.AllocatorStats.raw_changes",
            r#"#[cfg_attr(feature = "serde", serde(skip))]"#,
        )
        // Capacity estimates are JSON text on the wire, the object itself in
        // the serde form.
        .field_attribute(
            ".oomscope.v1.Diagnosis.capacity",
            serde_with(
                "crate::serde_forms::json_text",
                "crate::serde_forms::json_text_from",
            ),
        );
    for file in &fds.file {
        let package = format!(".{}", file.package());
        for message in &file.message_type {
            builder = oneofs(builder, &package, message);
            builder = enums_and_maps(builder, &package, message);
        }
    }
    builder.out_dir(&tmp).compile_fds(fds).expect("codegen");

    let fresh = std::fs::read_to_string(tmp.join("oomscope.v1.rs")).unwrap();
    let committed_path = out.join("oomscope.v1.rs");
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&tmp);
    if fresh != committed {
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(&committed_path, fresh).unwrap();
        panic!(
            "src/generated/oomscope.v1.rs was stale and has been regenerated; \
             review and commit it"
        );
    }
}

fn serde_with(ser: &str, de: &str) -> String {
    format!(
        r#"#[cfg_attr(feature = "serde", serde(serialize_with = "{ser}", deserialize_with = "{de}"))]"#
    )
}

/// Enum fields as their lowercase value names (prost stores them as `i32`,
/// which serde would write as a number), and maps in key order (prost's are
/// `HashMap`s), numbers among them as `serde_forms::sorted_numbers` writes
/// them: the forms `src/serde_forms.rs` gives.
fn enums_and_maps(mut builder: Builder, scope: &str, message: &DescriptorProto) -> Builder {
    let path = format!("{scope}.{}", message.name());
    for field in &message.field {
        let at = format!("{path}.{}", field.name());
        if field.r#type() == Type::Enum {
            // A top-level enum of the package is `crate::v1::Name`.
            let name = field
                .type_name()
                .strip_prefix(scope_package(scope))
                .unwrap();
            assert!(
                !name.contains('.'),
                "{at}: a nested enum needs its module path here"
            );
            assert!(
                field.label() != Label::Repeated && field.oneof_index.is_none(),
                "{at}: only singular enum fields outside a oneof have a serde form yet \
                 (src/serde_forms.rs)"
            );
            builder = builder.field_attribute(
                at,
                serde_with(
                    &format!("crate::serde_forms::enum_name::<crate::v1::{name}, _>"),
                    &format!("crate::serde_forms::enum_from_name::<crate::v1::{name}, _>"),
                ),
            );
        } else if let Some(value) = map_value(message, field.type_name()) {
            let ser = match value {
                Type::Double => "crate::serde_forms::sorted_numbers",
                _ => "crate::serde_forms::sorted",
            };
            builder = builder.field_attribute(
                at,
                format!(r#"#[cfg_attr(feature = "serde", serde(serialize_with = "{ser}"))]"#),
            );
        }
    }
    for nested in message.nested_type.iter().filter(|n| !is_map_entry(n)) {
        builder = enums_and_maps(builder, &path, nested);
    }
    builder
}

/// `.oomscope.v1.` of any scope inside that package.
fn scope_package(scope: &str) -> &'static str {
    assert!(scope.starts_with(".oomscope.v1"), "{scope}");
    ".oomscope.v1."
}

fn is_map_entry(m: &DescriptorProto) -> bool {
    m.options.as_ref().is_some_and(|o| o.map_entry())
}

/// The value type of a map field (its type is a nested `...Entry` message).
fn map_value(message: &DescriptorProto, type_name: &str) -> Option<Type> {
    let entry = type_name.rsplit('.').next()?;
    let m = message
        .nested_type
        .iter()
        .find(|n| n.name() == entry && is_map_entry(n))?;
    let value = m.field.iter().find(|f| f.name() == "value")?;
    Some(value.r#type())
}

/// Flattens each oneof of `message` (and of its nested messages) into its
/// message, and names each member by its proto field name (prost's variant is
/// the name in UpperCamelCase).
fn oneofs(mut builder: Builder, scope: &str, message: &DescriptorProto) -> Builder {
    let path = format!("{scope}.{}", message.name());
    for (index, oneof) in message.oneof_decl.iter().enumerate() {
        let members: Vec<_> = message
            .field
            .iter()
            .filter(|f| f.oneof_index == Some(index as i32) && !f.proto3_optional())
            .collect();
        // A proto3 `optional` field's synthetic oneof: prost makes it an
        // `Option` field, which serde already handles (null when unset).
        if members.is_empty() {
            continue;
        }
        // Without the leading dot this matches the oneof field only: prost
        // matches a dotted path as a prefix too, which would put `flatten`
        // on the members, where serde rejects it.
        builder = builder.field_attribute(format!("{}.{}", &path[1..], oneof.name()), FLATTEN);
        for member in members {
            builder = builder.field_attribute(
                format!("{path}.{}.{}", oneof.name(), member.name()),
                format!(
                    r#"#[cfg_attr(feature = "serde", serde(rename = "{}"))]"#,
                    member.name()
                ),
            );
        }
    }
    for nested in &message.nested_type {
        builder = oneofs(builder, &path, nested);
    }
    builder
}
