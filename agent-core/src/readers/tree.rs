//! The supervised process tree: a child and all its descendants, with each
//! one's RSS and PSS. A server that forks workers (vLLM's EngineCore and
//! Worker) holds most of its memory outside the process `oomscope run`
//! started, and the kernel's OOM record names whichever of them it killed:
//! the tree is both the instance's memory and the set of pids that are ours.
//!
//! Parents come from `/proc/<pid>/stat` (field 4, ppid) over the whole proc
//! root: it sees children of every thread. Between full walks,
//! [`TreeWatch::refresh_children`] follows `/proc/<pid>/task/<pid>/children`
//! from the known processes only, cheap enough for every poll, so that a
//! short-lived worker (one the OOM killer picks within milliseconds of its
//! start) is still known as ours.

use std::collections::HashMap;
use std::time::Instant;

use super::processes::{command_line, parse_status_fields};
use super::text::{kb_line_bytes, read_opt};
use super::HostPaths;
use crate::pb;

/// The most processes a tree reading lists: it is sent with every sample,
/// so a fork bomb must not make samples unbounded.
pub const MAX_TREE_PROCESSES: usize = 256;
/// The most pids remembered as "ours" in one run (a server that forks a
/// short-lived helper per request would grow the set forever otherwise).
/// Past it, new pids are still read but no longer remembered.
pub const MAX_SEEN_PIDS: usize = 65536;
/// How many parents an ancestry check follows before giving up (pid 1 is
/// reached long before in any real tree; this bounds a garbled /proc).
const MAX_ANCESTRY_DEPTH: usize = 64;

/// The parent pid (field 4) of a `/proc/<pid>/stat` text. The name (field 2)
/// may hold spaces and parentheses, so fields are counted after the last ')'.
pub fn parse_stat_ppid(text: &str) -> Option<u32> {
    let after_comm = &text[text.rfind(')')? + 1..];
    // after_comm starts at field 3 (state); field 4 is next.
    after_comm.split_whitespace().nth(1)?.parse().ok()
}

/// The `Pss:` line of `/proc/<pid>/smaps_rollup`, in bytes.
pub fn parse_smaps_pss(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(kb_line_bytes)
}

/// The pids of a `/proc/<pid>/task/<tid>/children` text (space-separated).
pub fn parse_children(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// `root` and its descendants, root first, then breadth-first in pid order,
/// at most `max`. Empty when `root` is not in the proc root.
pub fn descendants(paths: &HostPaths, root: u32, max: usize) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut root_seen = false;
    let Ok(entries) = std::fs::read_dir(&paths.proc_root) else {
        return Vec::new();
    };
    for pid in entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok()) {
        if pid == root {
            root_seen = true;
            continue;
        }
        if let Some(ppid) = read_opt(&paths.pid_file(pid, "stat"))
            .as_deref()
            .and_then(parse_stat_ppid)
        {
            children.entry(ppid).or_default().push(pid);
        }
    }
    if !root_seen {
        return Vec::new();
    }
    breadth_first(root, &mut children, max)
}

fn breadth_first(root: u32, children: &mut HashMap<u32, Vec<u32>>, max: usize) -> Vec<u32> {
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() && out.len() < max {
        if let Some(mut kids) = children.remove(&out[i]) {
            kids.sort_unstable();
            let room = max - out.len();
            out.extend(kids.into_iter().take(room));
        }
        i += 1;
    }
    out.truncate(max);
    out
}

/// One process of the tree: its memory, parent, title and command line.
/// None when it is gone (its status file cannot be read).
pub fn describe(paths: &HostPaths, pid: u32) -> Option<pb::ProcessInfo> {
    let status = read_opt(&paths.pid_file(pid, "status"))?;
    let fields = parse_status_fields(&status);
    let title = read_opt(&paths.pid_file(pid, "comm"))
        .map(|c| c.trim_end_matches('\n').to_string())
        .unwrap_or(fields.name);
    let command = read_opt(&paths.pid_file(pid, "cmdline"))
        .map(|c| command_line(&c))
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| format!("[{title}]"));
    Some(pb::ProcessInfo {
        pid,
        command,
        rss_bytes: fields.rss_bytes,
        pss_bytes: read_opt(&paths.pid_file(pid, "smaps_rollup"))
            .as_deref()
            .and_then(parse_smaps_pss)
            .unwrap_or(0),
        parent_pid: read_opt(&paths.pid_file(pid, "stat"))
            .as_deref()
            .and_then(parse_stat_ppid)
            .unwrap_or(0),
        title,
        ..Default::default()
    })
}

/// A reading of the tree: its processes and their sums.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TreeReading {
    pub processes: Vec<pb::ProcessInfo>,
    pub rss_bytes: u64,
    pub pss_bytes: u64,
}

impl TreeReading {
    /// Puts this reading into a sample's tree fields.
    pub fn fill(self, sample: &mut pb::Sample) {
        sample.tree = self.processes;
        sample.tree_rss_bytes = self.rss_bytes;
        sample.tree_pss_bytes = self.pss_bytes;
    }
}

/// Reads the tree under `root` (at most `max` processes); processes that
/// vanish between the walk and their reading are left out of the sums too.
pub fn read(paths: &HostPaths, root: u32, max: usize) -> TreeReading {
    let processes: Vec<pb::ProcessInfo> = descendants(paths, root, max)
        .into_iter()
        .filter_map(|pid| describe(paths, pid))
        .collect();
    TreeReading {
        rss_bytes: processes.iter().map(|p| p.rss_bytes).sum(),
        pss_bytes: processes.iter().map(|p| p.pss_bytes).sum(),
        processes,
    }
}

/// True when `ancestor` is `pid` or one of its ancestors, as /proc shows
/// them now (a process that is gone, reaped, has no ancestry).
pub fn descends_from(paths: &HostPaths, pid: u32, ancestor: u32) -> bool {
    let mut p = pid;
    for _ in 0..MAX_ANCESTRY_DEPTH {
        if p == ancestor {
            return true;
        }
        match read_opt(&paths.pid_file(p, "stat"))
            .as_deref()
            .and_then(parse_stat_ppid)
        {
            Some(pp) if pp != 0 && pp != p => p = pp,
            _ => return false,
        }
    }
    false
}

/// What a fork means to the tree ([`TreeWatch::forked`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fork {
    /// The child is a process of the tree.
    Ours,
    /// The child holds a pid the tree knew, outside it: that pid was
    /// freed and is someone else's now.
    Taken,
    /// Neither the child nor its parent is the tree's.
    Unrelated,
}

/// One run's tree: the latest reading's pids and every pid seen in it
/// since the run began, to tell whether a pid the kernel names is ours, and
/// what each process was (its title, command line, parent) once it is gone.
#[derive(Debug)]
pub struct TreeWatch {
    paths: HostPaths,
    root: u32,
    /// Whether the root is one of the processes watched, or only the
    /// ancestor of them (`oomscope run` after its child ended, watching the
    /// orphans it adopted as the tree's subreaper).
    root_listed: bool,
    /// The pids of the latest reading and of the children found since.
    current: Vec<u32>,
    /// Every pid seen, with when it was first seen.
    seen: HashMap<u32, Instant>,
    /// What each process was at the latest full reading that listed it.
    listed: HashMap<u32, pb::ProcessInfo>,
    /// Processes of the previous reading missing from the latest one.
    gone: Vec<pb::ProcessInfo>,
}

impl TreeWatch {
    pub fn new(paths: HostPaths, root: u32) -> Self {
        let mut seen = HashMap::new();
        seen.insert(root, Instant::now());
        TreeWatch {
            paths,
            root,
            root_listed: true,
            current: vec![root],
            seen,
            listed: HashMap::new(),
            gone: Vec::new(),
        }
    }

    /// From now on, the descendants of `root` without `root` itself: what a
    /// subreaper watches once the process it started has ended and its tree
    /// lives on. What was known of the processes stays known.
    pub fn watch_descendants_of(&mut self, root: u32) {
        self.root = root;
        self.root_listed = false;
        self.current = vec![root];
        self.gone.clear();
    }

    /// The full walk and reading, for a sample.
    pub fn read(&mut self) -> TreeReading {
        let mut reading = read(&self.paths, self.root, MAX_TREE_PROCESSES);
        if !self.root_listed {
            if let Some(i) = reading.processes.iter().position(|p| p.pid == self.root) {
                let me = reading.processes.remove(i);
                reading.rss_bytes -= me.rss_bytes;
                reading.pss_bytes -= me.pss_bytes;
            }
        }
        let before: Vec<u32> = std::mem::take(&mut self.current);
        self.current = reading.processes.iter().map(|p| p.pid).collect();
        self.gone = before
            .iter()
            .filter(|pid| !self.current.contains(pid))
            .filter_map(|pid| self.listed.get(pid).cloned())
            .collect();
        if self.current.is_empty() || !self.root_listed {
            self.current.insert(0, self.root);
        }
        for p in &reading.processes {
            self.remember(p.pid);
            if self.listed.len() < MAX_SEEN_PIDS || self.listed.contains_key(&p.pid) {
                self.listed.insert(p.pid, p.clone());
            }
        }
        reading
    }

    /// The processes the latest reading no longer found (ended, or moved
    /// out of the tree), as the reading before it saw them.
    pub fn gone(&self) -> &[pb::ProcessInfo] {
        &self.gone
    }

    /// The processes of the latest reading, the root excluded where it is
    /// not watched itself.
    pub fn members(&self) -> Vec<u32> {
        self.current
            .iter()
            .copied()
            .filter(|&p| self.root_listed || p != self.root)
            .collect()
    }

    /// Finds the children of the known processes' main threads (one small
    /// file each), remembering new ones. A child forked by another thread
    /// waits for the next full walk.
    pub fn refresh_children(&mut self) {
        let mut i = 0;
        while i < self.current.len() && self.current.len() < MAX_TREE_PROCESSES {
            let pid = self.current[i];
            let path = self
                .paths
                .proc_root
                .join(pid.to_string())
                .join("task")
                .join(pid.to_string())
                .join("children");
            if let Some(text) = read_opt(&path) {
                for child in parse_children(&text) {
                    if !self.current.contains(&child) {
                        self.current.push(child);
                        self.remember(child);
                    }
                }
            }
            i += 1;
        }
    }

    /// True when `pid` is the root or was seen in its tree during this run,
    /// or descends from the root now (a process the walks missed but that
    /// is still there, a zombie included).
    pub fn owns(&self, pid: u32) -> bool {
        self.seen.contains_key(&pid) || descends_from(&self.paths, pid, self.root)
    }

    /// Follows a fork the kernel reported (process events, in order): a
    /// child of a process of the tree is ours, and a pid the run knew that
    /// a process outside the tree now holds is not ours any more: it was
    /// freed and taken again, and what it does now is someone else's.
    pub fn forked(&mut self, parent: u32, child: u32) -> Fork {
        if child == self.root || self.seen.contains_key(&parent) {
            self.remember(child);
            return Fork::Ours;
        }
        if !self.seen.contains_key(&child) {
            return Fork::Unrelated;
        }
        // A parent the walks and the events missed may still be ours.
        if descends_from(&self.paths, parent, self.root) {
            self.remember(child);
            return Fork::Ours;
        }
        self.forget(child);
        Fork::Taken
    }

    /// `pid` begins a new life in the tree (its earlier one ended): it is
    /// seen from now on, and what a reading listed of the earlier one no
    /// longer describes it.
    pub fn renew(&mut self, pid: u32) {
        self.forget(pid);
        self.remember(pid);
    }

    fn forget(&mut self, pid: u32) {
        self.seen.remove(&pid);
        self.listed.remove(&pid);
        self.current.retain(|&p| p != pid || p == self.root);
    }

    /// When `pid` was first seen in the tree, if it was.
    pub fn first_seen(&self, pid: u32) -> Option<Instant> {
        self.seen.get(&pid).copied()
    }

    /// What `pid` was at the latest full reading that listed it; None for
    /// a process no full reading caught (one that lived less than a sample
    /// interval).
    pub fn last_listed(&self, pid: u32) -> Option<&pb::ProcessInfo> {
        self.listed.get(&pid)
    }

    fn remember(&mut self, pid: u32) {
        if self.seen.len() < MAX_SEEN_PIDS {
            self.seen.entry(pid).or_insert_with(Instant::now);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// One fake process: `<root>/<pid>/{stat,status,comm,cmdline,smaps_rollup}`.
    fn fake(root: &Path, pid: u32, ppid: u32, comm: &str, rss_kb: u64, pss_kb: Option<u64>) {
        let d = root.join(pid.to_string());
        std::fs::create_dir_all(d.join("task").join(pid.to_string())).unwrap();
        std::fs::write(
            d.join("stat"),
            format!("{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 100 0 0 0"),
        )
        .unwrap();
        std::fs::write(
            d.join("status"),
            format!("Name:\t{comm}\nUid:\t0\t0\t0\t0\nVmRSS:\t{rss_kb} kB\n"),
        )
        .unwrap();
        std::fs::write(d.join("comm"), format!("{comm}\n")).unwrap();
        std::fs::write(d.join("cmdline"), format!("{comm}\0--flag\0")).unwrap();
        if let Some(p) = pss_kb {
            std::fs::write(
                d.join("smaps_rollup"),
                format!(
                    "55d0-7ffd ---p 00000000 00:00 0 [rollup]\nRss:\t{rss_kb} kB\nPss:\t{p} kB\nPss_Anon:\t1 kB\n"
                ),
            )
            .unwrap();
        }
    }

    fn paths(root: &Path) -> HostPaths {
        HostPaths {
            proc_root: root.to_path_buf(),
            cgroup_root: root.join("no-cgroup"),
        }
    }

    #[test]
    fn stat_ppid_survives_a_name_with_spaces_and_parentheses() {
        assert_eq!(parse_stat_ppid("42 (a) b (c)) S 7 42 42 0"), Some(7));
        assert_eq!(parse_stat_ppid("42 (x"), None);
        assert_eq!(parse_stat_ppid(""), None);
        assert_eq!(parse_smaps_pss("Rss: 10 kB\nPss:   3 kB\n"), Some(3072));
        assert_eq!(parse_smaps_pss("Rss: 10 kB\n"), None);
        assert_eq!(parse_children("12 13 \n"), vec![12, 13]);
    }

    #[test]
    fn the_walk_finds_children_and_grandchildren_only() {
        let tmp = tempfile::tempdir().unwrap();
        let r = tmp.path();
        fake(r, 1, 0, "init", 10, Some(10));
        fake(r, 100, 1, "server", 1000, Some(800));
        fake(r, 101, 100, "VLLM::Worker", 3000, Some(2500));
        fake(r, 102, 100, "engine core", 2000, None); // PSS unreadable
        fake(r, 103, 101, "helper", 50, Some(40));
        fake(r, 200, 1, "other", 9999, Some(9999));
        std::fs::create_dir(r.join("self")).unwrap(); // not a pid
        let t = read(&paths(r), 100, MAX_TREE_PROCESSES);
        let pids: Vec<u32> = t.processes.iter().map(|p| p.pid).collect();
        assert_eq!(pids, vec![100, 101, 102, 103]);
        assert_eq!(t.rss_bytes, (1000 + 3000 + 2000 + 50) * 1024);
        assert_eq!(t.pss_bytes, (800 + 2500 + 40) * 1024);
        let w = &t.processes[1];
        assert_eq!(
            (w.parent_pid, w.title.as_str(), w.command.as_str()),
            (100, "VLLM::Worker", "VLLM::Worker --flag")
        );
        assert_eq!(t.processes[2].title, "engine core");
        assert_eq!(t.processes[2].pss_bytes, 0);

        // Bounded, root first.
        assert_eq!(descendants(&paths(r), 100, 2), vec![100, 101]);
        // A root that is gone gives nothing.
        assert!(read(&paths(r), 999, 10).processes.is_empty());
    }

    #[test]
    fn a_vanished_process_leaves_the_sums() {
        let tmp = tempfile::tempdir().unwrap();
        let r = tmp.path();
        fake(r, 100, 1, "server", 1000, Some(800));
        fake(r, 101, 100, "worker", 3000, Some(2500));
        std::fs::remove_file(r.join("101").join("status")).unwrap();
        let t = read(&paths(r), 100, 10);
        assert_eq!(t.processes.len(), 1);
        assert_eq!((t.rss_bytes, t.pss_bytes), (1000 * 1024, 800 * 1024));
    }

    #[test]
    fn the_watch_remembers_every_pid_of_the_run() {
        let tmp = tempfile::tempdir().unwrap();
        let r = tmp.path();
        fake(r, 100, 1, "sh", 1000, Some(800));
        fake(r, 200, 1, "other", 1000, Some(800));
        let mut w = TreeWatch::new(paths(r), 100);
        assert_eq!(w.read().processes.len(), 1);

        // A child appears between walks: the children file finds it.
        fake(r, 101, 100, "python3", 64 << 10, Some(60 << 10));
        std::fs::write(r.join("100/task/100/children"), "101 ").unwrap();
        w.refresh_children();
        assert!(w.owns(101));

        // It dies and is reaped: still ours for this run.
        std::fs::remove_dir_all(r.join("101")).unwrap();
        std::fs::write(r.join("100/task/100/children"), "").unwrap();
        assert_eq!(w.read().processes.len(), 1);
        assert!(w.owns(101));
        assert!(!w.owns(200), "a process outside the tree is not ours");
        assert!(!w.owns(4242), "an unknown, gone pid is not ours");

        // A grandchild the walks never saw, still there: its ancestry says it is ours.
        fake(r, 102, 100, "sh", 10, Some(10));
        fake(r, 103, 102, "python3", 10, Some(10));
        assert!(w.owns(103));
        assert!(descends_from(&paths(r), 103, 100));
        assert!(!descends_from(&paths(r), 200, 100));
    }

    #[test]
    fn forks_tell_the_trees_processes_from_a_pid_taken_by_another() {
        let tmp = tempfile::tempdir().unwrap();
        let r = tmp.path();
        fake(r, 100, 1, "server", 1000, Some(800));
        fake(r, 101, 100, "worker", 1000, Some(800));
        fake(r, 555, 1, "other", 1000, Some(800));
        let mut w = TreeWatch::new(paths(r), 100);
        assert_eq!(w.read().processes.len(), 2);

        // The server forks: its child is ours before any reading lists it.
        assert_eq!(w.forked(100, 102), Fork::Ours);
        assert!(w.owns(102));
        // A stranger's fork of a pid nobody knew: nothing of ours.
        assert_eq!(w.forked(555, 777), Fork::Unrelated);
        assert!(!w.owns(777));

        // The worker ends and a stranger's child takes its pid: not ours.
        std::fs::remove_dir_all(r.join("101")).unwrap();
        fake(r, 101, 555, "python3", 10, Some(10));
        assert!(w.owns(101) && w.last_listed(101).is_some(), "known before");
        assert_eq!(w.forked(555, 101), Fork::Taken);
        assert!(!w.owns(101), "someone else's now");
        assert!(w.last_listed(101).is_none());
        assert!(!w.members().contains(&101));

        // A child of a process the walks missed that descends from the root
        // is ours, even with a pid the run knew.
        fake(r, 103, 100, "sh", 10, Some(10));
        w.remember(104);
        assert_eq!(w.forked(103, 104), Fork::Ours);
        assert!(w.owns(104));

        // A new life of a listed pid: seen anew, the old listing gone.
        let before = w.first_seen(100).unwrap();
        fake(r, 102, 100, "worker", 10, Some(10));
        w.read();
        assert!(w.last_listed(102).is_some());
        std::thread::sleep(std::time::Duration::from_millis(5));
        w.renew(102);
        assert!(w.last_listed(102).is_none());
        assert!(w.first_seen(102).unwrap() > before);
        assert_eq!(
            w.forked(1, 100),
            Fork::Ours,
            "the root is ours whoever started it"
        );
    }
}
