//! What a cgroup is, from paths of the shapes real hosts have: Kubernetes
//! pods and containers (cgroupfs and systemd drivers; containerd, CRI-O and
//! Docker), plain Docker and containerd, systemd services, and a plain
//! cgroup. The table is tests/fixtures/cgroup-paths/identities.tsv.

use oomscope_supervisor::node::identify;

#[test]
fn each_path_shape_names_its_container() {
    let table = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/cgroup-paths/identities.tsv"
    ))
    .unwrap();
    let mut checked = 0;
    for line in table
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let f: Vec<&str> = line.split('\t').collect();
        assert_eq!(f.len(), 7, "{line}");
        let id = identify(f[0]);
        let got = [
            id.kind,
            &id.pod_uid,
            &id.qos,
            &id.container_id,
            &id.runtime,
            &id.unit,
        ];
        assert_eq!(got, f[1..], "{}", f[0]);
        checked += 1;
    }
    assert!(checked >= 15, "the table has {checked} rows");
}

#[test]
fn names_are_short_and_distinct_per_container() {
    let uid = "0f3a1b2c_1d2e_4f50_8a9b_0c1d2e3f4a5b";
    let a = format!(
        "/kubepods.slice/kubepods-pod{uid}.slice/cri-containerd-{}.scope",
        "a".repeat(64)
    );
    let b = format!(
        "/kubepods.slice/kubepods-pod{uid}.slice/cri-containerd-{}.scope",
        "b".repeat(64)
    );
    let (na, nb) = (identify(&a).name(&a), identify(&b).name(&b));
    assert_eq!(na, format!("pod-0f3a1b2c-1d2-{}", "a".repeat(12)));
    assert_ne!(na, nb);
    assert_eq!(
        identify("/system.slice/nginx.service").name("/system.slice/nginx.service"),
        "nginx.service"
    );
    assert_eq!(identify("/a/b/app").name("/a/b/app"), "app");
    assert_eq!(identify("/").name("/"), "root");
}

#[test]
fn the_labels_carry_what_is_known_and_nothing_empty() {
    let p = format!("/docker/{}", "c".repeat(64));
    let labels = identify(&p).labels();
    assert_eq!(
        labels,
        [
            ("container.kind".to_string(), "docker".to_string()),
            ("container.id".to_string(), "c".repeat(64)),
            ("container.runtime".to_string(), "docker".to_string()),
        ]
    );
}
