//! Agent streams that no live agent sends: recorded ones read back from
//! capture files ([`capture`]), for `oomscope replay` and the tests. Agents
//! never link this crate (nor flate2 for gzipped captures).

pub mod capture;
