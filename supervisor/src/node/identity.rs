//! What a cgroup is, from its path alone: a Kubernetes pod or container
//! (cgroupfs and systemd drivers), a Docker, containerd or CRI-O container,
//! a systemd service, or a plain cgroup. Pure: path in, identity out.

/// What runs in a cgroup, as its path names it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ContainerIdentity {
    /// "kubernetes", "docker", "containerd", "crio", "systemd" or "cgroup".
    pub kind: &'static str,
    /// The pod's UID (dashes, as the API shows it), for Kubernetes.
    pub pod_uid: String,
    /// The pod's QoS class ("guaranteed", "burstable", "besteffort").
    pub qos: String,
    /// The container's id (64 hex digits) where the path names one.
    pub container_id: String,
    /// The container runtime named by the path ("docker", "containerd", "crio").
    pub runtime: String,
    /// The systemd unit, for a service.
    pub unit: String,
}

impl ContainerIdentity {
    /// A short readable name: the agent's name in the collector.
    pub fn name(&self, path: &str) -> String {
        let short = |id: &str| id.chars().take(12).collect::<String>();
        match self.kind {
            "kubernetes" if !self.container_id.is_empty() => {
                format!("pod-{}-{}", short(&self.pod_uid), short(&self.container_id))
            }
            "kubernetes" => format!("pod-{}", short(&self.pod_uid)),
            "docker" | "containerd" | "crio" => {
                format!("{}-{}", self.kind, short(&self.container_id))
            }
            "systemd" => self.unit.clone(),
            _ => {
                let last = path.trim_end_matches('/').rsplit('/').next().unwrap_or("");
                if last.is_empty() {
                    "root".to_string()
                } else {
                    last.to_string()
                }
            }
        }
    }

    /// The Hello labels that carry it (`container.*`), empty fields left out.
    pub fn labels(&self) -> Vec<(String, String)> {
        [
            ("container.kind", self.kind.to_string()),
            ("container.pod_uid", self.pod_uid.clone()),
            ("container.qos", self.qos.clone()),
            ("container.id", self.container_id.clone()),
            ("container.runtime", self.runtime.clone()),
            ("container.unit", self.unit.clone()),
        ]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

/// The identity a cgroup path names. Segments are read from the leaf up, so
/// the deepest container id wins (a pod's sandbox and its containers).
pub fn identify(path: &str) -> ContainerIdentity {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let mut id = ContainerIdentity {
        kind: "cgroup",
        ..Default::default()
    };
    // Kubernetes: a pod segment anywhere on the path.
    if let Some(pos) = segments.iter().position(|s| pod_uid(s).is_some()) {
        id.kind = "kubernetes";
        id.pod_uid = pod_uid(segments[pos]).unwrap_or_default();
        id.qos = qos(&segments[..=pos]);
        if let Some((runtime, cid)) = segments[pos + 1..].iter().rev().find_map(|s| container(s)) {
            id.runtime = runtime.to_string();
            id.container_id = cid;
        }
        return id;
    }
    let named = segments.iter().rev().find_map(|s| container(s));
    if let Some((runtime, cid)) = named.filter(|(r, _)| !r.is_empty()) {
        id.kind = runtime;
        id.runtime = runtime.to_string();
        id.container_id = cid;
        return id;
    }
    // cgroupfs Docker ("/docker/<id>") and containerd namespaces ("/default/<id>").
    if segments.len() >= 2 {
        let (parent, last) = (segments[segments.len() - 2], segments[segments.len() - 1]);
        if is_container_id(last) {
            id.kind = match parent {
                "docker" => "docker",
                "crio" => "crio",
                _ => "containerd",
            };
            id.runtime = id.kind.to_string();
            id.container_id = last.to_string();
            return id;
        }
    }
    if let Some(unit) = segments.iter().rev().find(|s| s.ends_with(".service")) {
        id.kind = "systemd";
        id.unit = unit.to_string();
    }
    id
}

/// The pod UID of a pod segment: "pod<uid>" (cgroupfs driver, dashes kept)
/// or "kubepods-burstable-pod<uid>.slice" (systemd driver, dashes as '_').
fn pod_uid(segment: &str) -> Option<String> {
    let s = segment.strip_suffix(".slice").unwrap_or(segment);
    let at = s.rfind("pod")?;
    if at > 0 && !s[..at].ends_with('-') {
        return None;
    }
    if at > 0 && !s.starts_with("kubepods") {
        return None;
    }
    let uid = s[at + 3..].replace('_', "-");
    let hex = uid.chars().filter(|c| *c != '-').count();
    let ok = hex == 32 && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-');
    ok.then_some(uid)
}

/// The QoS class the kubepods segments before the pod name ("burstable",
/// "besteffort"); a pod directly under kubepods is guaranteed.
fn qos(segments: &[&str]) -> String {
    for s in segments {
        for class in ["burstable", "besteffort"] {
            if *s == class || s.contains(&format!("kubepods-{class}")) {
                return class.to_string();
            }
        }
    }
    "guaranteed".to_string()
}

/// A container segment of the systemd driver: "docker-<id>.scope",
/// "cri-containerd-<id>.scope", "crio-<id>.scope" (a "crio-conmon-<id>"
/// scope is the monitor, not the container).
fn container(segment: &str) -> Option<(&'static str, String)> {
    let s = segment.strip_suffix(".scope").unwrap_or(segment);
    let (runtime, cid) = if let Some(c) = s.strip_prefix("cri-containerd-") {
        ("containerd", c)
    } else if let Some(c) = s.strip_prefix("docker-") {
        ("docker", c)
    } else if let Some(c) = s.strip_prefix("crio-") {
        ("crio", c)
    } else if let Some(c) = s.strip_prefix("containerd-") {
        ("containerd", c)
    } else {
        // cgroupfs driver under a pod: the bare id.
        return is_container_id(s).then(|| (runtime_unknown(), s.to_string()));
    };
    is_container_id(cid).then(|| (runtime, cid.to_string()))
}

/// A bare id under a pod says nothing of its runtime.
fn runtime_unknown() -> &'static str {
    ""
}

/// 64 lowercase hex digits: the ids Docker, containerd and CRI-O give.
fn is_container_id(s: &str) -> bool {
    s.len() == 64 && s.chars().all(|c| c.is_ascii_hexdigit())
}
