//! Loading and validating a configuration for a job: the job's defaults underneath the file and
//! the `--set` overrides, lockstep's own checks (sections, limits; the built-in jobs' model and
//! data), then the job's. The config types and their TOML mechanics live in `lockstep-run`
//! (plain data, no burn); what needs a job or the model's memory estimate is here, as the
//! [`ConfigLoad`] trait on [`TrainConfig`].

use std::path::Path;

use crate::config::{invalid, ConfigError, TrainConfig};
use crate::job::JobSpec;
use lockstep_run::{ModelShape, ParallelPlan};

/// Loading a [`TrainConfig`] for a job with every check (import it to call these on
/// `TrainConfig`).
pub trait ConfigLoad: Sized {
    /// Load `path` (or the built-in defaults when `None`), apply `key=value` overrides, validate
    /// for lockstep's built-in jobs.
    fn load(path: Option<&Path>, overrides: &[String]) -> Result<Self, ConfigError>;
    /// [`ConfigLoad::load`] from TOML text.
    fn from_toml_str(text: &str, origin: &str, overrides: &[String]) -> Result<Self, ConfigError>;
    /// [`ConfigLoad::load`] for `job`: its default config underneath the file, then the
    /// overrides; lockstep's own sections are validated, then the job's settings by the job.
    fn load_for(
        job: &dyn JobSpec,
        path: Option<&Path>,
        overrides: &[String],
    ) -> Result<Self, ConfigError>;
    /// [`ConfigLoad::from_toml_str`] for `job` (see [`ConfigLoad::load_for`]).
    fn from_toml_str_for(
        job: &dyn JobSpec,
        text: &str,
        origin: &str,
        overrides: &[String],
    ) -> Result<Self, ConfigError>;
    /// Full validation of a config of lockstep's built-in jobs.
    fn validate(&self) -> Result<(), ConfigError>;
    /// The built-in jobs: `[model]` and `[data]`, no `[job]`, then lockstep's own sections and
    /// the memory the model needs.
    fn validate_builtin(&self) -> Result<(), ConfigError>;
    /// A user job trained whole: lockstep's own sections (train, optimizer, dist, checkpoint,
    /// parallel) and what its model can do ([`ParallelPlan::check_shape`]). The `[model]` and
    /// `[data]` sections belong to the built-in jobs and are ignored.
    fn validate_common(&self, shape: &ModelShape) -> Result<(), ConfigError>;
    /// A user's layered job ([`crate::job::LayeredJob`]): like [`ConfigLoad::validate_common`],
    /// with pipelines allowed (the stages are checked against the model's layers once the job
    /// has built it).
    fn validate_common_layered(&self) -> Result<(), ConfigError>;
}

impl ConfigLoad for TrainConfig {
    fn load(path: Option<&Path>, overrides: &[String]) -> Result<Self, ConfigError> {
        Self::load_for(&crate::builtin::BuiltinJob, path, overrides)
    }

    fn from_toml_str(text: &str, origin: &str, overrides: &[String]) -> Result<Self, ConfigError> {
        Self::from_toml_str_for(&crate::builtin::BuiltinJob, text, origin, overrides)
    }

    fn load_for(
        job: &dyn JobSpec,
        path: Option<&Path>,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let (text, origin) = match path {
            Some(p) => (
                lockstep_run::read::read_text(p, lockstep_run::read::CONFIG_MAX_BYTES).map_err(
                    |cause| ConfigError::Read {
                        path: p.to_path_buf(),
                        cause,
                    },
                )?,
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

    fn from_toml_str_for(
        job: &dyn JobSpec,
        text: &str,
        origin: &str,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let defaults = job.default_config();
        let defaults_origin = format!("the default config of job `{}`", job.name());
        let cfg = TrainConfig::parse((&defaults, &defaults_origin), text, origin, overrides)?;
        job.validate(&cfg)?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.validate_builtin()
    }

    fn validate_builtin(&self) -> Result<(), ConfigError> {
        if let Some(key) = self.job.keys().next() {
            return Err(invalid(
                "job",
                format!(
                    "`job.{key}`: lockstep's built-in models take no [job] settings \
                     (that table is for your own jobs built with the lockstep library)"
                ),
            ));
        }
        if !self.train.init_from.is_empty() {
            return Err(invalid(
                "train.init_from",
                "lockstep's built-in models are not burn modules and load no burn record (it is \
                 for your own Job or LayeredJob); resume a run with --resume instead",
            ));
        }
        if self.optimizer.kind == crate::config::OptimizerKind::Custom {
            return Err(invalid(
                "optimizer.kind",
                "`custom` runs a job's own update rule (`Job::update_rule`), and lockstep's \
                 built-in models have none: choose sgd, adam or adamw",
            ));
        }
        self.validate_model_and_data()?;
        ParallelPlan::check_shape(self, &self.builtin_shape(self.pipeline_layers()))?;
        self.validate_sections()?;
        crate::limits::check(self, crate::limits::host_memory_bytes())
    }

    fn validate_common(&self, shape: &ModelShape) -> Result<(), ConfigError> {
        ParallelPlan::check_shape(self, shape)?;
        self.validate_common_layered()
    }

    fn validate_common_layered(&self) -> Result<(), ConfigError> {
        let init = &self.train.init_from;
        if !init.is_empty() && !Path::new(init).is_file() {
            return Err(invalid(
                "train.init_from",
                format!("`{init}` is not a readable file (a burn record, e.g. from `export`)"),
            ));
        }
        self.validate_parallel(None)?;
        self.validate_sections()?;
        crate::limits::check_common(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OptimizerKind;

    #[test]
    fn defaults_are_valid_and_round_trip() {
        let c = TrainConfig::load(None, &[]).unwrap();
        assert_eq!(c, TrainConfig::default());
        let again = TrainConfig::from_toml_str(&c.to_toml(), "resolved", &[]).unwrap();
        assert_eq!(again, c);
        assert_eq!(c.hash_hex(), again.hash_hex());
    }

    #[test]
    fn overrides_apply_with_types() {
        let c = TrainConfig::from_toml_str(
            "[train]\nsteps = 5\n",
            "t.toml",
            &[
                "train.steps=20".into(),
                "train.lr=0.5".into(),
                "model.hidden=[32]".into(),
                "optimizer.kind=adamw".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.train.steps, 20);
        assert_eq!(c.train.lr, 0.5);
        assert_eq!(c.model.hidden, vec![32]);
        assert_eq!(c.optimizer.kind, OptimizerKind::AdamW);
    }

    #[test]
    fn errors_name_the_field() {
        let e = TrainConfig::from_toml_str("", "x", &["train.microbatch=7".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.microbatch"), "{e}");
        let e = TrainConfig::from_toml_str("[train]\nstepz = 3\n", "bad.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("stepz") && e.contains("bad.toml"), "{e}");
        let e = TrainConfig::from_toml_str("[train]\nsteps = \"many\"\n", "bad.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("steps"), "{e}");
        let e = TrainConfig::from_toml_str("", "x", &["dist.transport=carrier-pigeon".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("dist.transport") && e.contains("carrier-pigeon"),
            "{e}"
        );
        let e = TrainConfig::from_toml_str("", "x", &["train.lr=-1".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.lr"), "{e}");
        let e = TrainConfig::from_toml_str("", "x", &["dist.overlap=sometimes".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("overlap") && e.contains("bool"), "{e}");
        let c = TrainConfig::from_toml_str("[dist]\noverlap = true\n", "x", &[]).unwrap();
        assert!(c.dist.overlap && !TrainConfig::default().dist.overlap);
        let e = TrainConfig::from_toml_str("", "x", &["nonsense".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("key=value"), "{e}");
        let e = TrainConfig::from_toml_str("", "x", &["train.steps.x=1".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.steps"), "{e}");
        let e = TrainConfig::from_toml_str("[train\n", "broken.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("broken.toml"), "{e}");
    }
}
