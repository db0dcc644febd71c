//! Loading and validating a configuration for a job: the job's defaults underneath the file and
//! the `--set` overrides, lockstep's own checks (sections, limits; the built-in jobs' model and
//! data), then the job's. Kept apart from `config.rs` (the types and the TOML mechanics), which
//! depends on nothing else in the crate.

use std::path::Path;

use crate::config::{apply_override, invalid, merge, table_has, ConfigError, TrainConfig};
use crate::job::JobSpec;

impl TrainConfig {
    /// Load `path` (or the built-in defaults when `None`), apply `key=value` overrides, validate.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Self, ConfigError> {
        let (text, origin) = match path {
            Some(p) => (
                std::fs::read_to_string(p).map_err(|cause| ConfigError::Read {
                    path: p.to_path_buf(),
                    cause,
                })?,
                p.display().to_string(),
            ),
            None => (String::new(), "built-in defaults".to_string()),
        };
        Self::from_toml_str(&text, &origin, overrides)
    }

    pub fn from_toml_str(
        text: &str,
        origin: &str,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        Self::from_toml_str_for(&crate::builtin::BuiltinJob, text, origin, overrides)
    }

    /// [`TrainConfig::load`] for `job`: its default config underneath the file, then the
    /// overrides; lockstep's own sections are validated, then the job's settings by the job.
    pub fn load_for(
        job: &dyn JobSpec,
        path: Option<&Path>,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let (text, origin) = match path {
            Some(p) => (
                std::fs::read_to_string(p).map_err(|cause| ConfigError::Read {
                    path: p.to_path_buf(),
                    cause,
                })?,
                p.display().to_string(),
            ),
            None if job.default_config().is_empty() => (String::new(), "built-in defaults".into()),
            None => (
                String::new(),
                format!("the defaults of job `{}`", job.name()),
            ),
        };
        Self::from_toml_str_for(job, &text, &origin, overrides)
    }

    /// [`TrainConfig::from_toml_str`] for `job` (see [`TrainConfig::load_for`]).
    pub fn from_toml_str_for(
        job: &dyn JobSpec,
        text: &str,
        origin: &str,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let parse = |text: &str, origin: &str| {
            text.parse::<toml::Table>()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    origin: origin.into(),
                    message: e.to_string(),
                })
        };
        let defaults = job.default_config();
        let mut table = parse(
            &defaults,
            &format!("the default config of job `{}`", job.name()),
        )?;
        merge(&mut table, parse(text, origin)?);
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        let both_micro = table_has(&table, "train", "microbatch")
            && table_has(&table, "parallel", "microbatches");
        let mut cfg: TrainConfig =
            toml::Value::Table(table)
                .try_into()
                .map_err(|e: toml::de::Error| {
                    let origin = if overrides.is_empty() {
                        origin.to_string()
                    } else {
                        format!("{origin} with --set overrides")
                    };
                    ConfigError::Parse {
                        origin,
                        message: e.to_string().trim().replace('\n', " "),
                    }
                })?;
        cfg.resolve_microbatches(both_micro)?;
        job.validate(&cfg)?;
        Ok(cfg)
    }

    /// Full validation of a config of lockstep's built-in jobs.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_builtin()
    }

    /// The built-in jobs: `[model]` and `[data]`, no `[job]`, then lockstep's own sections and
    /// the memory the model needs.
    pub fn validate_builtin(&self) -> Result<(), ConfigError> {
        if let Some(key) = self.job.keys().next() {
            return Err(invalid(
                "job",
                format!(
                    "`job.{key}`: lockstep's built-in models take no [job] settings \
                     (that table is for your own jobs built with the lockstep library)"
                ),
            ));
        }
        self.validate_model_and_data()?;
        self.validate_sections()?;
        crate::limits::check(self, crate::limits::host_memory_bytes())
    }

    /// A user job: lockstep's own sections (train, optimizer, dist, checkpoint, parallel). The
    /// `[model]` and `[data]` sections belong to the built-in jobs and are ignored.
    pub fn validate_common(&self) -> Result<(), ConfigError> {
        if self.parallel.pp > 1 {
            return Err(invalid(
                "parallel.pp",
                format!(
                    "{} pipeline stages need a model written as a sequence of layers: implement \
                     lockstep::LayeredJob and run lockstep::main(lockstep::Pipelined(job)); \
                     this job runs data-parallel only (parallel.pp = 1)",
                    self.parallel.pp
                ),
            ));
        }
        if self.parallel.tp > 1 {
            return Err(invalid(
                "parallel.tp",
                format!(
                    "{} tensor-parallel ranks need a model written as a sequence of layers with \
                     tensor-parallel layers in it: implement lockstep::LayeredJob with \
                     lockstep::tp::ColumnParallelLinear and RowParallelLinear, and run \
                     lockstep::main(lockstep::Pipelined(job)); this job runs with parallel.tp = 1",
                    self.parallel.tp
                ),
            ));
        }
        if self.parallel.zero >= 3 {
            return Err(invalid(
                "parallel.zero",
                "ZeRO 3 gathers the parameters layer by layer, which needs a model written as a \
                 sequence of layers: implement lockstep::LayeredJob and run \
                 lockstep::main(lockstep::Pipelined(job)); use parallel.zero = 0, 1 or 2 here",
            ));
        }
        self.validate_common_layered()
    }

    /// A user's layered job ([`crate::job::LayeredJob`]): like [`TrainConfig::validate_common`],
    /// with pipelines allowed (the stages are checked against the model's layers once the job
    /// has built it).
    pub fn validate_common_layered(&self) -> Result<(), ConfigError> {
        self.validate_parallel(None)?;
        self.validate_sections()?;
        crate::limits::check_common(self)
    }
}
