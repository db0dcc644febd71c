//! Per-parameter gradients handed out during backward, for communication/compute overlap.
//!
//! burn 0.22 has no backward hooks, so each parameter passes through an identity custom op
//! (`grad_tap`, a backend extension) whose hand-written backward copies the incoming gradient
//! (which is the parameter's complete gradient: every parameter is used exactly once) and sends
//! it with its canonical index into a channel.
//!
//! Why the op has a second, ignored input (`anchor`, the input of the layer using the
//! parameter): burn's autodiff runs backward steps grouped by node depth (`order` = 1 + the
//! deepest input), deepest first. An identity op on a parameter leaf alone has depth 1, so
//! every tap would run only at the very end of backward and nothing would overlap. Anchoring
//! the tap on the layer's input gives it depth `order(input) + 1`: it runs right after the
//! backward of the layer that consumes it and before the layers below. Its backward sends no
//! gradient to the anchor, so the anchor's gradient is unchanged.
//!
//! The channel is drained by a scoped thread that calls the caller's callback, so the callback
//! (e.g. starting an all-reduce) runs concurrently with the rest of backward and may borrow from
//! the caller. Delivery ends with an explicit `Done` message sent by a drop guard, so an early
//! return or panic never leaves the draining thread waiting.

use crate::net::ParamTap;
use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::Tensor;
use std::sync::mpsc::Sender;

/// What the taps send to the draining thread.
pub(crate) enum Msg {
    /// Gradient of the parameter with this canonical index.
    Grad(usize, Vec<f32>),
    /// Backward finished (or was abandoned): stop draining.
    Done,
}

/// Where a tap's backward delivers its gradient.
#[derive(Clone, Debug)]
pub struct GradSink {
    index: usize,
    tx: Sender<Msg>,
}

#[backend_extension(Flex, Autodiff)]
pub trait GradTap: Backend {
    /// Identity on `param`; backward reports the gradient to `sink`. `anchor` only orders the
    /// op in the backward schedule.
    fn grad_tap(
        param: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        sink: GradSink,
    ) -> FloatTensor<Self>;
}

impl GradTap for Flex {
    fn grad_tap(
        param: FloatTensor<Self>,
        _anchor: FloatTensor<Self>,
        _sink: GradSink,
    ) -> FloatTensor<Self> {
        param
    }
}

#[derive(Debug)]
struct TapBackward {
    sink: GradSink,
}

impl Backward<Flex, 2> for TapBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<Flex>(&ops.node);
        let values = grad
            .into_data()
            .try_into_vec::<f32>()
            .expect("lockstep-model gradients are f32 by construction");
        // The receiver only disappears if the caller's scope is unwinding; nothing to do then.
        let _ = self.sink.tx.send(Msg::Grad(self.sink.index, values));
        // Neither the parameter leaf nor the anchor gets a gradient from here: the parameter's
        // gradient was just delivered, and the anchor's output does not depend on it.
    }
}

impl<C: CheckpointStrategy> GradTap for Autodiff<Flex, C> {
    fn grad_tap(
        param: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        sink: GradSink,
    ) -> FloatTensor<Self> {
        let tap = TapBackward { sink };
        match tap
            .prepare::<C>([param.node(), anchor.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), param.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(param.into_primitive()),
        }
    }
}

/// Wraps every parameter in a `grad_tap` sending to `tx`.
pub(crate) struct StreamTap {
    pub(crate) tx: Sender<Msg>,
}

impl ParamTap for StreamTap {
    fn tap<const D: usize, const A: usize>(
        &self,
        index: usize,
        param: Tensor<D>,
        anchor: &Tensor<A>,
    ) -> Tensor<D> {
        let sink = GradSink {
            index,
            tx: self.tx.clone(),
        };
        Tensor::from_dispatch(<Dispatch as GradTap>::grad_tap(
            param.into_dispatch(),
            anchor.clone().into_dispatch(),
            sink,
        ))
    }
}

/// Sends `Done` when dropped, whatever path leaves the producing scope.
pub(crate) struct DoneOnDrop(pub(crate) Sender<Msg>);

impl Drop for DoneOnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(Msg::Done);
    }
}
