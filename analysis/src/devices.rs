//! One evidence's GPU readings, joined into devices by identity.
//!
//! The parties that read a GPU number it differently: PyTorch (the
//! allocator, the OOM event, the error text's "GPU 2 has a total capacity")
//! by its ordinal, which counts the devices CUDA_VISIBLE_DEVICES leaves, in
//! CUDA_DEVICE_ORDER; NVML by its index, which is PCI order on the host (a
//! MIG instance carries its parent's). Only the UUID means one thing to all of
//! them, so readings join by UUID. An ordinal that no reading ties to a UUID
//! is mapped through CUDA_VISIBLE_DEVICES, else to the one GPU in sight, else
//! to the one GPU NVML lists the process on; otherwise it stays unmapped:
//! unknown, never "device 0".
//!
//! The pids NVML reports on a device are the host's; in a container they are
//! not the process's own, so a pid is judged by the agent's view of it
//! (`PidView`) and, where that is unresolved, by its usage against the
//! process's own figures (`Holder`, `Whose`).

use crate::evidence::Evidence;
use crate::pb;
use crate::pb::event::Kind;
use crate::torch_text::{self, TorchOomText};
use crate::units::bytes_short;

/// An unresolved pid whose usage is at least this share of the process's
/// own reserved bytes could be the process (NVML and the allocator read at
/// different moments; the text rounds to two decimals).
const OWN_SLACK: f64 = 0.01;
/// What a process holds on a device beyond its allocator's reserved bytes:
/// the CUDA context (0.5 GiB measured on the H200 in other_process_shared:
/// NVML 4.51 GiB for 4.00 GiB reserved; 1-2 GiB with eager module loading),
/// cuBLAS/cuDNN workspaces and NCCL buffers. An unresolved pid within this of
/// the process's own reserved bytes matches the process.
pub const OWN_OVERHEAD_BYTES: u64 = 3 << 30;

/// One GPU or MIG instance, with what each reading says of it.
#[derive(Clone, Debug, Default)]
pub struct Device<'a> {
    /// "GPU-…", or "MIG-…" for a MIG instance; None where no reading names it.
    pub uuid: Option<String>,
    /// For a MIG instance: its parent GPU's uuid.
    pub parent_uuid: Option<String>,
    /// PyTorch's ordinal of it in the agent's process.
    pub ordinal: Option<i32>,
    /// NVML's index (the parent GPU's for a MIG instance).
    pub nvml_index: Option<i32>,
    pub name: String,
    /// Its own total: a MIG instance's, never its parent's.
    pub total_bytes: Option<u64>,
    /// A per-process cap the agent announced.
    pub cap_bytes: Option<u64>,
    /// NVML could not read it (its words): its figures are unknown.
    pub unreadable: Option<String>,
    /// NVML's newest readable reading of it, up to the failure.
    pub nvml: Option<&'a pb::GpuDevice>,
    /// How its ordinal was tied to it where no reading named both.
    pub mapped: Option<Mapping>,
}

/// How an ordinal was tied to a device that no reading named with it.
#[derive(Clone, Debug, PartialEq)]
pub struct Mapping {
    pub how: String,
    /// False where the tie rests on an assumption (CUDA's default
    /// FASTEST_FIRST order over unlike GPUs).
    pub certain: bool,
}

impl Device<'_> {
    pub fn is_mig(&self) -> bool {
        self.parent_uuid.is_some()
    }

    /// "GPU-8f2a… (NVIDIA H100 80GB HBM3)" or, without a uuid, "GPU 2".
    pub fn label(&self) -> String {
        let id = match (&self.uuid, self.ordinal, self.nvml_index) {
            (Some(u), _, _) => u.clone(),
            (None, Some(o), _) => format!("GPU {o}"),
            (None, None, Some(i)) => format!("NVML GPU {i}"),
            (None, None, None) => "the GPU".to_string(),
        };
        match self.name.is_empty() {
            true => id,
            false => format!("{id} ({})", self.name),
        }
    }

    /// "on NVML GPU 3", "on MIG-… of NVML GPU 0", "on GPU 2".
    pub fn place(&self) -> String {
        match (self.is_mig(), &self.uuid, self.nvml_index, self.ordinal) {
            (true, Some(u), Some(i), _) => format!("on {u} (a MIG instance of NVML GPU {i})"),
            (true, Some(u), None, _) => format!("on {u} (a MIG instance)"),
            (false, _, Some(i), _) => format!("on NVML GPU {i}"),
            (_, _, _, Some(o)) => format!("on GPU {o}"),
            _ => "on the GPU".to_string(),
        }
    }

    /// The limit an allocation on it runs into: the announced per-process
    /// cap, else its own total.
    pub fn limit(&self) -> Option<(u64, &'static str)> {
        if let Some(cap) = self.cap_bytes {
            return Some((cap, "the per-process cap"));
        }
        let what = match self.is_mig() {
            true => "the MIG instance's total",
            false => "the device total",
        };
        self.total_bytes.map(|t| (t, what))
    }

    /// Device-wide used bytes as NVML read them.
    pub fn used_bytes(&self) -> Option<u64> {
        self.nvml.map(|g| g.used_bytes)
    }

    /// The keys that find this device's readings.
    pub fn key(&self) -> DeviceKey {
        DeviceKey {
            uuid: self.uuid.clone(),
            ordinal: self.ordinal,
            nvml_index: self.nvml_index,
            mig: self.is_mig(),
        }
    }

    /// `g` is an NVML reading of this device.
    pub fn read_by(&self, g: &pb::GpuDevice) -> bool {
        self.key().reads(g)
    }

    fn lists(&self, p: &pb::GpuProcess) -> bool {
        self.key().lists(p)
    }
}

/// What identifies one device in each party's readings: PyTorch's by uuid,
/// else by ordinal; NVML's by uuid, else by index. The timeline, the report's
/// memory table and the holders all pick readings through it, so a process
/// that fails on its GPU 3 is never shown GPU 0's numbers.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceKey {
    pub uuid: Option<String>,
    pub ordinal: Option<i32>,
    pub nvml_index: Option<i32>,
    pub mig: bool,
}

impl DeviceKey {
    /// The failing device as a diagnosis carries it.
    pub fn of_failed(d: &pb::FailedDevice) -> DeviceKey {
        DeviceKey {
            uuid: (!d.uuid.is_empty()).then(|| d.uuid.clone()),
            ordinal: d.ordinal,
            nvml_index: d.nvml_index,
            mig: !d.parent_uuid.is_empty(),
        }
    }

    /// An older diagnosis's failure, known by PyTorch's ordinal alone.
    pub fn of_ordinal(ordinal: i32) -> DeviceKey {
        DeviceKey {
            ordinal: Some(ordinal),
            ..Default::default()
        }
    }

    /// This device's allocator reading among a sample's. A key that names
    /// nothing (the device is unknown) takes the first, as the one device
    /// such a process reads; a known device takes only its own, never
    /// another's numbers.
    pub fn allocator<'s>(
        key: Option<&DeviceKey>,
        stats: &'s [pb::AllocatorStats],
    ) -> Option<&'s pb::AllocatorStats> {
        match key.filter(|k| k.uuid.is_some() || k.ordinal.is_some()) {
            None => stats.first(),
            Some(k) => stats.iter().find(|a| k.is_allocator(a)),
        }
    }

    fn is_allocator(&self, a: &pb::AllocatorStats) -> bool {
        match (&self.uuid, a.device_uuid.is_empty()) {
            (Some(u), false) => same_uuid(u, &a.device_uuid),
            _ => self.ordinal == Some(a.device),
        }
    }

    /// `g` is an NVML reading of this device.
    pub fn reads(&self, g: &pb::GpuDevice) -> bool {
        match (&self.uuid, g.uuid.is_empty()) {
            (Some(u), false) => same_uuid(u, &g.uuid),
            (_, true) => !self.mig && self.nvml_index == Some(g.index),
            (None, false) => false,
        }
    }

    /// A process list's entry is on this device: by uuid, or (an older
    /// agent's entry without one) by NVML's index on a whole GPU; an index
    /// alone cannot say which MIG instance.
    pub fn lists(&self, p: &pb::GpuProcess) -> bool {
        match (&self.uuid, p.device_uuid.is_empty()) {
            (Some(u), false) => same_uuid(u, &p.device_uuid),
            (_, true) => !self.mig && self.nvml_index == Some(p.device),
            (None, false) => false,
        }
    }
}

/// Whose memory an NVML process entry is, as far as the evidence tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Whose {
    /// This process or its tree: by the agent's view, or by number.
    Own,
    /// Another process, by the agent's view or by number.
    Other,
    /// A pid from another PID namespace whose usage matches this process's
    /// own figures: this process.
    OwnUnresolved,
    /// A pid from another PID namespace whose usage is not this process's.
    OtherUnresolved,
    /// A pid from another PID namespace that the figures cannot place.
    Unresolved,
}

/// One process on a device, as NVML (or the error text) reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct Holder {
    pub pid: u32,
    /// None where NVML could not give it: unknown, never 0.
    pub used_bytes: Option<u64>,
    pub whose: Whose,
    pub user: String,
    pub command: String,
}

impl Holder {
    pub fn is_own(&self) -> bool {
        matches!(self.whose, Whose::Own | Whose::OwnUnresolved)
    }

    pub fn is_other(&self) -> bool {
        matches!(self.whose, Whose::Other | Whose::OtherUnresolved)
    }

    /// "pid 3141592 38.0 GiB" or "pid 8888 (usage not given by NVML)", with
    /// whose it is where that is not plain.
    pub fn describe(&self) -> String {
        let used = match self.used_bytes {
            Some(b) => bytes_short(b),
            None => "(usage not given by NVML)".to_string(),
        };
        let whose = match self.whose {
            Whose::Own => " (this process)",
            Whose::OwnUnresolved => " (this process, by its usage)",
            Whose::OtherUnresolved | Whose::Unresolved => " (another PID namespace)",
            Whose::Other => "",
        };
        format!("pid {}{whose} {used}", self.pid)
    }
}

/// The devices of one evidence and the one its failure is about.
#[derive(Clone, Debug, Default)]
pub struct Devices<'a> {
    pub list: Vec<Device<'a>>,
    failing: Option<(usize, String)>,
    /// PyTorch's text at the failure (the OOM's, else the exit's stderr).
    text: TorchOomText,
    /// NVML's pids are not this process's namespace's: the agent said so
    /// (`PID_VIEW_UNRESOLVED`), or PyTorch's text lists processes without
    /// "this process" (it did not find its own pid among them).
    pub foreign_pids: bool,
    /// Why the failing ordinal could not be tied to a device, where it could not.
    pub unmapped: Option<String>,
}

/// Where the failure is: the OOM event's device, else the error text's ordinal.
struct Site {
    uuid: Option<String>,
    ordinal: Option<i32>,
    from: &'static str,
}

impl<'a> Devices<'a> {
    pub fn of(e: &'a Evidence) -> Devices<'a> {
        let (site, text) = site(e);
        let mut d = Devices {
            foreign_pids: foreign_pids(e, &text),
            text,
            ..Default::default()
        };
        d.add_nvml(e);
        d.add_placements(e);
        d.add_allocator(e);
        if let (None, Some(k)) = (&site.uuid, site.ordinal) {
            let i = d.by_ordinal(k);
            if d.list[i].total_bytes.is_none() {
                d.list[i].total_bytes = d.text.total_bytes;
            }
        }
        d.map_ordinals(e);
        d.failing = d.find_failing(&site);
        d
    }

    /// The device the failure is about; without a failure, the one device
    /// the process uses (or the one in sight). None where that is unknown.
    pub fn failing(&self) -> Option<&Device<'a>> {
        self.failing.as_ref().map(|(i, _)| &self.list[*i])
    }

    /// The keys that find the failing device's readings.
    pub fn failing_key(&self) -> Option<DeviceKey> {
        self.failing().map(Device::key)
    }

    /// How the failing device was found.
    pub fn failing_how(&self) -> Option<&str> {
        self.failing.as_ref().map(|(_, how)| how.as_str())
    }

    /// The failing device as a diagnosis carries it.
    pub fn failed_device(&self) -> Option<pb::FailedDevice> {
        let (dev, how) = (self.failing()?, self.failing_how()?);
        Some(pb::FailedDevice {
            uuid: dev.uuid.clone().unwrap_or_default(),
            ordinal: dev.ordinal,
            nvml_index: dev.nvml_index,
            name: dev.name.clone(),
            parent_uuid: dev.parent_uuid.clone().unwrap_or_default(),
            total_bytes: dev.total_bytes,
            identified_by: how.to_string(),
            certain: dev.mapped.as_ref().is_none_or(|m| m.certain),
        })
    }

    /// The limit of the failing device (cap, else its own total); 0 if unknown.
    pub fn limit_bytes(&self) -> u64 {
        self.failing().and_then(Device::limit).map_or(0, |(l, _)| l)
    }

    /// The processes on `dev`: the process list's entries, else NVML's
    /// reading, else (for the failing device) PyTorch's text. `own_bytes`
    /// is what the process is known to hold there at least (its allocator's
    /// reserved bytes, or PyTorch's "this process has"): an unresolved pid
    /// is judged against it.
    pub fn holders(&self, e: &Evidence, dev: &Device, own_bytes: Option<u64>) -> Vec<Holder> {
        let own = e.own_pids();
        let whose = |pid: u32, view: i32| self.whose_by_view(&own, pid, view);
        let listed: Vec<Holder> = e
            .process_list()
            .into_iter()
            .flat_map(|l| l.gpu.iter())
            .filter(|p| dev.lists(p))
            .map(|p| Holder {
                pid: p.pid,
                used_bytes: p.used_bytes,
                whose: whose(p.pid, p.view),
                user: p.user.clone(),
                command: p.command.clone(),
            })
            .collect();
        let mut holders = if !listed.is_empty() {
            listed
        } else if let Some(g) = dev.nvml.filter(|g| !g.processes.is_empty()) {
            return self.reading_holders(e, g, own_bytes);
        } else if self.is_failing(dev) && !dev.is_mig() {
            // PyTorch's text names the failing device's processes; on a
            // MIG instance it asks about the parent GPU, every slice's.
            self.text
                .others
                .iter()
                .map(|&(pid, used_bytes)| Holder {
                    pid,
                    used_bytes,
                    whose: whose(pid, pb::PidView::Unspecified as i32),
                    user: String::new(),
                    command: String::new(),
                })
                .collect()
        } else {
            Vec::new()
        };
        place_unresolved(&mut holders, own_bytes);
        holders
    }

    /// The processes of one NVML reading, judged against `own_bytes`.
    pub fn reading_holders(
        &self,
        e: &Evidence,
        g: &pb::GpuDevice,
        own_bytes: Option<u64>,
    ) -> Vec<Holder> {
        let own = e.own_pids();
        let mut holders: Vec<Holder> = g
            .processes
            .iter()
            .map(|p| Holder {
                pid: p.pid,
                used_bytes: p.used_bytes,
                whose: self.whose_by_view(&own, p.pid, p.view),
                user: String::new(),
                command: String::new(),
            })
            .collect();
        place_unresolved(&mut holders, own_bytes);
        holders
    }

    /// The processes on the failing device, judged against `own_bytes`.
    pub fn failing_holders(&self, e: &Evidence, own_bytes: Option<u64>) -> Vec<Holder> {
        self.failing()
            .map(|d| self.holders(e, d, own_bytes))
            .unwrap_or_default()
    }

    fn is_failing(&self, dev: &Device) -> bool {
        self.failing().is_some_and(|f| std::ptr::eq(f, dev))
    }

    /// A pid by the agent's view of it: unresolved pids are neither own nor
    /// other by number; the others (and older agents' pids, unless NVML's
    /// pids are known to be another namespace's) compare by number.
    fn whose_by_view(&self, own: &[u32], pid: u32, view: i32) -> Whose {
        match pb::PidView::try_from(view).unwrap_or_default() {
            pb::PidView::Own => Whose::Own,
            pb::PidView::Unresolved => Whose::Unresolved,
            pb::PidView::Unspecified if self.foreign_pids => Whose::Unresolved,
            pb::PidView::Visible | pb::PidView::Unspecified => match own.contains(&pid) {
                true => Whose::Own,
                false => Whose::Other,
            },
        }
    }

    fn add_nvml(&mut self, e: &'a Evidence) {
        // Readings up to the failure; all of them where none precedes it.
        let death = e.death_time();
        let upto = |s: &&pb::Sample| death.is_none_or(|d| s.time_ns <= d);
        let any_before = e.samples.iter().filter(upto).any(|s| !s.gpus.is_empty());
        for s in e.samples.iter().filter(|s| !any_before || upto(s)) {
            for g in &s.gpus {
                let i = match g.uuid.is_empty() {
                    false => self.by_uuid(&g.uuid),
                    true => self.by_nvml_index(g.index),
                };
                let d = &mut self.list[i];
                d.nvml_index = Some(g.index);
                set_text(&mut d.name, &g.name);
                set_opt(&mut d.parent_uuid, &g.parent_uuid);
                if g.unreadable.is_empty() {
                    d.unreadable = None;
                    d.nvml = Some(g);
                    d.total_bytes = Some(g.total_bytes).filter(|&t| t > 0).or(d.total_bytes);
                } else {
                    d.unreadable = Some(g.unreadable.clone());
                    d.nvml = None;
                }
            }
        }
    }

    fn add_placements(&mut self, e: &Evidence) {
        for p in e.hello.iter().flat_map(|h| h.gpus.iter()) {
            let i = match (p.uuid.is_empty(), p.ordinal) {
                (false, _) => self.by_uuid(&p.uuid),
                (true, Some(o)) => self.by_ordinal(o),
                // An older agent's placement: NVML's index.
                (true, None) => self.by_nvml_index(p.index),
            };
            let d = &mut self.list[i];
            match p.ordinal {
                Some(o) => {
                    d.ordinal.get_or_insert(o);
                }
                None => {
                    d.nvml_index.get_or_insert(p.index);
                }
            }
            set_text(&mut d.name, &p.name);
            set_opt(&mut d.parent_uuid, &p.parent_uuid);
            if d.total_bytes.is_none() && p.total_bytes > 0 {
                d.total_bytes = Some(p.total_bytes);
            }
            if p.cap_bytes > 0 {
                d.cap_bytes = Some(p.cap_bytes);
            }
        }
    }

    /// The agent's allocator readings and OOM events: each ties an ordinal
    /// to a uuid where it carries one.
    fn add_allocator(&mut self, e: &Evidence) {
        let readings = e.samples.iter().flat_map(|s| s.allocator.iter());
        let ooms = e.events.iter().filter_map(|ev| match &ev.kind {
            Some(Kind::Oom(o)) => Some(o),
            _ => None,
        });
        let mut ties: Vec<(i32, &str, u64)> = readings
            .map(|a| (a.device, a.device_uuid.as_str(), a.driver_total_bytes))
            .collect();
        for o in ooms {
            let stats = o.stats.as_ref();
            let uuid = match o.device_uuid.is_empty() {
                false => o.device_uuid.as_str(),
                true => stats.map_or("", |s| s.device_uuid.as_str()),
            };
            ties.push((o.device, uuid, stats.map_or(0, |s| s.driver_total_bytes)));
        }
        for (ordinal, uuid, driver_total) in ties {
            let i = match uuid.is_empty() {
                false => self.by_uuid(uuid),
                true => self.by_ordinal(ordinal),
            };
            let d = &mut self.list[i];
            d.ordinal.get_or_insert(ordinal);
            if d.total_bytes.is_none() && driver_total > 0 {
                d.total_bytes = Some(driver_total);
            }
        }
    }

    /// Ties each ordinal that only the agent knows to a device NVML read.
    fn map_ordinals(&mut self, e: &Evidence) {
        let mut i = 0;
        while i < self.list.len() {
            let d = &self.list[i];
            let (Some(k), None, None) = (d.ordinal, &d.uuid, d.nvml_index) else {
                i += 1;
                continue;
            };
            // Another reading already tied this ordinal to a device.
            let tied = (0..self.list.len()).find(|&j| {
                let t = &self.list[j];
                j != i && t.ordinal == Some(k) && (t.uuid.is_some() || t.nvml_index.is_some())
            });
            let target = match tied {
                Some(j) => Ok((j, None)),
                None => self.through_env(e, k).map(|(j, m)| (j, Some(m))),
            };
            match target {
                Ok((j, mapping)) if self.list[j].ordinal.is_none_or(|o| o == k) => {
                    let agent = self.list.remove(i);
                    let j = if j > i { j - 1 } else { j };
                    let t = &mut self.list[j];
                    t.ordinal = Some(k);
                    t.cap_bytes = t.cap_bytes.or(agent.cap_bytes);
                    t.total_bytes = t.total_bytes.or(agent.total_bytes);
                    t.mapped = mapping;
                }
                Ok(_) => {
                    self.unmapped = Some(format!(
                        "ordinal {k} maps to a device another ordinal already holds"
                    ));
                    i += 1;
                }
                Err(why) => {
                    self.unmapped = Some(why);
                    i += 1;
                }
            }
        }
    }

    /// Ordinal `k` through CUDA_VISIBLE_DEVICES; without it, the one GPU
    /// in sight, else the one GPU NVML lists the process on.
    fn through_env(&self, e: &Evidence, k: i32) -> Result<(usize, Mapping), String> {
        let Some(env) = visible_devices(e) else {
            return self.without_env(e, k);
        };
        let entries = visible_entries(env);
        let Some(entry) = usize::try_from(k).ok().and_then(|k| entries.get(k)) else {
            return Err(format!(
                "ordinal {k} is past the {} device(s) CUDA_VISIBLE_DEVICES={env} leaves",
                entries.len()
            ));
        };
        match entry {
            Entry::Uuid(u) => {
                let found: Vec<usize> = self
                    .in_sight()
                    .filter(|&j| {
                        self.list[j]
                            .uuid
                            .as_deref()
                            .is_some_and(|v| uuid_prefix(u, v))
                    })
                    .collect();
                match found[..] {
                    [j] => Ok((
                        j,
                        Mapping {
                            how: format!("CUDA_VISIBLE_DEVICES={env} makes ordinal {k} {u}"),
                            certain: true,
                        },
                    )),
                    _ => Err(format!(
                        "CUDA_VISIBLE_DEVICES={env} makes ordinal {k} {u}, which names no one device NVML read"
                    )),
                }
            }
            Entry::Index(n) => {
                let whole: Vec<usize> = self.whole_gpus().collect();
                let Some(&j) = whole.iter().find(|&&j| self.list[j].nvml_index == Some(*n)) else {
                    return Err(format!(
                        "CUDA_VISIBLE_DEVICES={env} makes ordinal {k} the device at index {n}, which NVML did not read"
                    ));
                };
                if self.has_mig_instances(j) {
                    return Err(format!(
                        "CUDA_VISIBLE_DEVICES={env} names GPU {n} by index, but it is split into MIG instances"
                    ));
                }
                let pci =
                    cuda_device_order(e).is_some_and(|o| o.eq_ignore_ascii_case("PCI_BUS_ID"));
                let first = &self.list[whole[0]];
                let alike = whole.iter().all(|&w| {
                    let g = &self.list[w];
                    g.name == first.name && g.total_bytes == first.total_bytes
                });
                let why = if pci {
                    "CUDA_DEVICE_ORDER=PCI_BUS_ID, NVML's order"
                } else if alike {
                    "CUDA's default FASTEST_FIRST order is NVML's PCI order for alike GPUs"
                } else {
                    "uncertain: CUDA's default FASTEST_FIRST order may differ from NVML's PCI order over unlike GPUs"
                };
                Ok((
                    j,
                    Mapping {
                        how: format!(
                            "CUDA_VISIBLE_DEVICES={env} makes ordinal {k} the GPU at index {n}: NVML GPU {n} ({why})"
                        ),
                        certain: pci || alike,
                    },
                ))
            }
        }
    }

    fn without_env(&self, e: &Evidence, k: i32) -> Result<(usize, Mapping), String> {
        let usable: Vec<usize> = self.usable().collect();
        if let [j] = usable[..] {
            return Ok((
                j,
                Mapping {
                    how: format!("no CUDA_VISIBLE_DEVICES and one GPU in sight: ordinal {k} is it"),
                    certain: true,
                },
            ));
        }
        // The process has a context on the device it failed on, so NVML
        // lists it there.
        let own = e.own_pids();
        let with_us: Vec<usize> = usable
            .into_iter()
            .filter(|&j| {
                self.list[j].nvml.is_some_and(|g| {
                    g.processes
                        .iter()
                        .any(|p| self.whose_by_view(&own, p.pid, p.view) == Whose::Own)
                })
            })
            .collect();
        match with_us[..] {
            [j] => Ok((
                j,
                Mapping {
                    how: format!(
                        "no CUDA_VISIBLE_DEVICES; NVML lists the process on this GPU alone, so ordinal {k} is it"
                    ),
                    certain: true,
                },
            )),
            _ => Err(format!(
                "no CUDA_VISIBLE_DEVICES was recorded and {} GPUs are in sight: ordinal {k} is not tied to one",
                self.usable().count()
            )),
        }
    }

    fn find_failing(&self, site: &Site) -> Option<(usize, String)> {
        let described = |j: usize, said: String| {
            let d = &self.list[j];
            match &d.mapped {
                Some(m) => (j, format!("{said}; {}", m.how)),
                None if d.uuid.is_some() && said.contains("ordinal") => (
                    j,
                    format!("{said}; the agent's readings tie that ordinal to its uuid"),
                ),
                None => (j, said),
            }
        };
        if let Some(u) = &site.uuid {
            let j = self.find(|d| d.uuid.as_deref().is_some_and(|v| same_uuid(u, v)))?;
            return Some((j, format!("{} names it", site.from)));
        }
        if let Some(k) = site.ordinal {
            let j = self.find(|d| d.ordinal == Some(k))?;
            let mut how = format!("{} is on ordinal {k}", site.from);
            if self.list[j].uuid.is_none() && self.list[j].nvml_index.is_none() {
                if let Some(why) = &self.unmapped {
                    how.push_str(&format!("; its identity is unknown: {why}"));
                }
            }
            return Some(described(j, how));
        }
        // No device named: the one the process uses, else the one in sight.
        let used: Vec<usize> = (0..self.list.len())
            .filter(|&j| self.list[j].ordinal.is_some())
            .collect();
        if let [j] = used[..] {
            return Some(described(j, "the one device the process uses".to_string()));
        }
        let usable: Vec<usize> = self.usable().collect();
        match (used.is_empty(), &usable[..]) {
            (true, [j]) => Some((*j, "the one GPU in sight".to_string())),
            _ => None,
        }
    }

    fn find(&self, pick: impl Fn(&Device) -> bool) -> Option<usize> {
        self.list.iter().position(pick)
    }

    /// Devices NVML (or an older agent's placement) read.
    fn in_sight(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.list.len()).filter(|&j| self.list[j].nvml_index.is_some())
    }

    fn whole_gpus(&self) -> impl Iterator<Item = usize> + '_ {
        self.in_sight().filter(|&j| !self.list[j].is_mig())
    }

    fn has_mig_instances(&self, j: usize) -> bool {
        let Some(u) = &self.list[j].uuid else {
            return false;
        };
        self.list
            .iter()
            .any(|d| d.parent_uuid.as_deref().is_some_and(|p| same_uuid(p, u)))
    }

    /// What CUDA can hand a process: whole GPUs and MIG instances (never a
    /// GPU split into instances).
    fn usable(&self) -> impl Iterator<Item = usize> + '_ {
        self.in_sight().filter(|&j| !self.has_mig_instances(j))
    }

    fn by_uuid(&mut self, uuid: &str) -> usize {
        self.find(|d| d.uuid.as_deref().is_some_and(|u| same_uuid(u, uuid)))
            .unwrap_or_else(|| {
                self.list.push(Device {
                    uuid: Some(uuid.to_string()),
                    ..Default::default()
                });
                self.list.len() - 1
            })
    }

    fn by_ordinal(&mut self, ordinal: i32) -> usize {
        self.find(|d| d.ordinal == Some(ordinal))
            .unwrap_or_else(|| {
                self.list.push(Device {
                    ordinal: Some(ordinal),
                    ..Default::default()
                });
                self.list.len() - 1
            })
    }

    /// A device known by NVML's index alone (older readings without a uuid).
    fn by_nvml_index(&mut self, index: i32) -> usize {
        self.find(|d| d.uuid.is_none() && !d.is_mig() && d.nvml_index == Some(index))
            .unwrap_or_else(|| {
                self.list.push(Device {
                    nvml_index: Some(index),
                    ..Default::default()
                });
                self.list.len() - 1
            })
    }
}

/// Moves unresolved pids to own or other by their usage: the process has a
/// context on the device, so where no pid is its own by view or number, one
/// of the unresolved pids is the process. One that holds at least the
/// process's own reserved bytes and no more than `OWN_OVERHEAD_BYTES` beyond
/// them is the process, and so is the only one large enough to be it; those
/// too small to be it are other processes. Without the process's figures,
/// or where several could be it, they stay unresolved.
fn place_unresolved(holders: &mut [Holder], own_bytes: Option<u64>) {
    let own_found = holders.iter().any(|h| h.whose == Whose::Own);
    let Some(own) = own_bytes else {
        return;
    };
    let unresolved = |h: &Holder| h.whose == Whose::Unresolved && h.used_bytes.is_some();
    if own_found {
        for h in holders.iter_mut().filter(|h| unresolved(h)) {
            h.whose = Whose::OtherUnresolved;
        }
        return;
    }
    let floor = own as f64 * (1.0 - OWN_SLACK);
    let big_enough = |h: &Holder| h.used_bytes.is_some_and(|u| u as f64 >= floor);
    let matching =
        |h: &Holder| big_enough(h) && h.used_bytes.is_some_and(|u| u <= own + OWN_OVERHEAD_BYTES);
    let candidates = holders
        .iter()
        .filter(|h| unresolved(h) && big_enough(h))
        .count();
    let matches = holders
        .iter()
        .filter(|h| unresolved(h) && matching(h))
        .count();
    for h in holders.iter_mut().filter(|h| unresolved(h)) {
        h.whose = if !big_enough(h) {
            Whose::OtherUnresolved
        } else if candidates == 1 || (matches == 1 && matching(h)) {
            Whose::OwnUnresolved
        } else if matches >= 1 && !matching(h) {
            Whose::OtherUnresolved
        } else {
            Whose::Unresolved
        };
    }
}

/// The OOM event's device, else the ordinal of PyTorch's text on the
/// stderr of the exit the incident is about; and that text, parsed.
fn site(e: &Evidence) -> (Site, TorchOomText) {
    if let Some((_, o)) = e.oom() {
        let text = torch_text::parse(&o.error_text);
        let uuid = Some(o.device_uuid.clone()).filter(|u| !u.is_empty());
        let site = Site {
            uuid,
            ordinal: Some(o.device),
            from: "the OOM event",
        };
        return (site, text);
    }
    let stderr = e.child_exit().map_or("", |(_, x)| x.stderr_tail.as_str());
    let text = torch_text::parse(stderr);
    let site = Site {
        uuid: None,
        ordinal: text.ordinal,
        from: "the error text",
    };
    (site, text)
}

/// NVML's pids are another namespace's: the agent found a pid it could not
/// resolve, or PyTorch listed NVML's processes without finding its own.
fn foreign_pids(e: &Evidence, text: &TorchOomText) -> bool {
    let unresolved = pb::PidView::Unresolved as i32;
    let by_agent = e
        .samples
        .iter()
        .flat_map(|s| s.gpus.iter().flat_map(|g| g.processes.iter()))
        .any(|p| p.view == unresolved)
        || e.process_list()
            .is_some_and(|l| l.gpu.iter().any(|p| p.view == unresolved));
    by_agent || (!text.others.is_empty() && !text.names_this_process)
}

/// The Hello's CUDA_VISIBLE_DEVICES, else the label `oomscope run` records.
fn visible_devices(e: &Evidence) -> Option<&str> {
    let h = e.hello.as_ref()?;
    h.cuda_visible_devices
        .as_deref()
        .or_else(|| h.labels.get("env.CUDA_VISIBLE_DEVICES").map(String::as_str))
}

fn cuda_device_order(e: &Evidence) -> Option<&str> {
    let h = e.hello.as_ref()?;
    h.cuda_device_order
        .as_deref()
        .or_else(|| h.labels.get("env.CUDA_DEVICE_ORDER").map(String::as_str))
}

/// One entry of CUDA_VISIBLE_DEVICES.
#[derive(Clone, Debug, PartialEq)]
enum Entry {
    /// The n-th device in CUDA_DEVICE_ORDER.
    Index(i32),
    /// "GPU-…" (a unique prefix will do) or "MIG-…".
    Uuid(String),
}

/// CUDA_VISIBLE_DEVICES as CUDA reads it: comma-separated entries, up to
/// the first one it cannot read (CUDA ignores it and all after it).
fn visible_entries(env: &str) -> Vec<Entry> {
    let mut entries = Vec::new();
    for raw in env.split(',').map(str::trim) {
        let upper = raw.to_ascii_uppercase();
        let entry = if let Ok(n) = raw.parse::<i32>() {
            (n >= 0).then_some(Entry::Index(n))
        } else if (upper.starts_with("GPU-") || upper.starts_with("MIG-"))
            // The older MIG form "MIG-GPU-<uuid>/<gi>/<ci>" names no instance uuid.
            && !raw.contains('/')
        {
            Some(Entry::Uuid(raw.to_string()))
        } else {
            None
        };
        match entry {
            Some(x) => entries.push(x),
            None => break,
        }
    }
    entries
}

fn normal(uuid: &str) -> String {
    let u = uuid.trim().to_ascii_lowercase();
    u.strip_prefix("gpu-")
        .or_else(|| u.strip_prefix("mig-"))
        .map(str::to_string)
        .unwrap_or(u)
}

/// The same device: uuids compare without case and with or without their
/// prefix. PyTorch's uuid has none; the driver API's 16 bytes do not say
/// whether they name a MIG instance, so a Rust agent writes "GPU-" before a
/// MIG instance's hex, which NVML writes "MIG-". The hex alone is unique.
/// (A pre-R470 "MIG-GPU-<parent>/gi/ci" name keeps its "gpu-<parent>/…"
/// and never equals its parent.)
pub fn same_uuid(a: &str, b: &str) -> bool {
    !a.trim().is_empty() && normal(a) == normal(b)
}

/// CUDA_VISIBLE_DEVICES's entry `entry` (a uuid or a prefix of one) names `uuid`.
fn uuid_prefix(entry: &str, uuid: &str) -> bool {
    let e = normal(entry);
    e.len() >= 4 && normal(uuid).starts_with(&e)
}

fn set_text(into: &mut String, from: &str) {
    if into.is_empty() && !from.is_empty() {
        *into = from.to_string();
    }
}

fn set_opt(into: &mut Option<String>, from: &str) {
    if into.is_none() && !from.is_empty() {
        *into = Some(from.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visible_devices_read_as_cuda_reads_them() {
        assert_eq!(
            visible_entries("3, GPU-8f2a,MIG-5c1d"),
            vec![
                Entry::Index(3),
                Entry::Uuid("GPU-8f2a".into()),
                Entry::Uuid("MIG-5c1d".into())
            ]
        );
        // CUDA stops at the first entry it cannot read.
        assert_eq!(visible_entries("1,-1,2"), vec![Entry::Index(1)]);
        assert_eq!(visible_entries("0,foo,2"), vec![Entry::Index(0)]);
        assert!(visible_entries("").is_empty());
        assert!(visible_entries("MIG-GPU-8f2a/1/0").is_empty());
    }

    #[test]
    fn uuids_compare_with_or_without_the_prefix() {
        assert!(same_uuid(
            "GPU-68e78067-40bf-94a2-6927-1b2d520e0103",
            "68E78067-40BF-94A2-6927-1B2D520E0103"
        ));
        assert!(!same_uuid("", ""));
        assert!(uuid_prefix("GPU-68e7", "GPU-68e78067-40bf"));
        assert!(!uuid_prefix("GPU-", "GPU-68e78067-40bf"));
    }

    #[test]
    fn readings_with_and_without_the_uuid_are_one_device() {
        let reading = |uuid: &str| pb::Sample {
            allocator: vec![pb::AllocatorStats {
                device: 1,
                device_uuid: uuid.into(),
                driver_total_bytes: 80 << 30,
                ..Default::default()
            }],
            ..Default::default()
        };
        let e = Evidence {
            samples: vec![
                reading(""),
                reading("GPU-3b1c2a9e-7d4f-5e60-8a1b-2c3d4e5f6a71"),
            ],
            events: vec![pb::Event {
                time_ns: 1,
                kind: Some(Kind::Oom(pb::Oom {
                    device: 1,
                    ..Default::default()
                })),
            }],
            ..Default::default()
        };
        let d = Devices::of(&e);
        assert_eq!(d.list.len(), 1, "{:?}", d.list);
        let f = d.failed_device().unwrap();
        assert_eq!(
            (f.uuid.as_str(), f.ordinal, f.total_bytes),
            (
                "GPU-3b1c2a9e-7d4f-5e60-8a1b-2c3d4e5f6a71",
                Some(1),
                Some(80 << 30)
            )
        );
        assert_eq!(
            f.identified_by,
            "the OOM event is on ordinal 1; the agent's readings tie that ordinal to its uuid"
        );
    }

    fn holder(pid: u32, gib: Option<u64>, whose: Whose) -> Holder {
        Holder {
            pid,
            used_bytes: gib.map(|g| g << 30),
            whose,
            user: String::new(),
            command: String::new(),
        }
    }

    #[test]
    fn an_unresolved_pid_is_placed_by_its_usage() {
        use Whose::*;
        // Our 70 GiB and a neighbour's 20 GiB, both seen from another namespace.
        let mut h = vec![
            holder(1, Some(71), Unresolved),
            holder(2, Some(20), Unresolved),
        ];
        place_unresolved(&mut h, Some(70 << 30));
        assert_eq!((h[0].whose, h[1].whose), (OwnUnresolved, OtherUnresolved));
        // A neighbour larger than us, beside us.
        let mut h = vec![
            holder(1, Some(11), Unresolved),
            holder(2, Some(60), Unresolved),
        ];
        place_unresolved(&mut h, Some(10 << 30));
        assert_eq!((h[0].whose, h[1].whose), (OwnUnresolved, OtherUnresolved));
        // Two alike: either could be us.
        let mut h = vec![
            holder(1, Some(11), Unresolved),
            holder(2, Some(11), Unresolved),
        ];
        place_unresolved(&mut h, Some(10 << 30));
        assert_eq!((h[0].whose, h[1].whose), (Unresolved, Unresolved));
        // Without our figures nothing is placed; unknown usage stays unknown.
        let mut h = vec![holder(1, Some(11), Unresolved), holder(2, None, Unresolved)];
        place_unresolved(&mut h, None);
        assert_eq!((h[0].whose, h[1].whose), (Unresolved, Unresolved));
    }
}
